//! Token sampling: logit processors (penalties, bias) then temperature / top-k / top-p / min-p and
//! a seeded draw. Semantics follow vLLM: repetition penalty over prompt and output (divide
//! positive logits, multiply negative ones), presence and frequency penalties over output tokens.

pub mod choice_constraint;
pub mod constraint;
pub mod json_constraint;
pub mod json_number;
pub mod json_schema;
pub mod schema_constraint;
pub mod stop;
pub mod tool_call_constraint;

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 (or >= vocab) disables top-k.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    pub logit_bias: HashMap<u32, f32>,
    /// vLLM's `allowed_token_ids`: only these tokens may be sampled (EOS too only if listed).
    #[serde(default)]
    pub allowed_token_ids: Option<Vec<u32>>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: HashMap::new(),
            allowed_token_ids: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    pub fn validate(&self) -> Result<(), String> {
        let bad = |f: &str, v: f32, range: &str| Err(format!("'{f}' must be {range}, got {v}"));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature, "a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", self.repetition_penalty, "> 0");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", self.presence_penalty, "in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]");
        }
        Ok(())
    }
}

/// Per-request sampler state: the parameters, the RNG and the output-token counts penalties use.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    output_counts: HashMap<u32, u32>,
    /// Prompt tokens, kept only when the repetition penalty needs them.
    prompt_tokens: Vec<u32>,
}

/// A chosen token and its log-probability under the final (processed) distribution.
#[derive(Clone, Copy, Debug)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_rng(&mut rand::rng()),
        };
        let prompt_tokens = if params.repetition_penalty != 1.0 { prompt.to_vec() } else { Vec::new() };
        Self { params, rng, output_counts: HashMap::new(), prompt_tokens }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token (call after each sample, also for forced tokens).
    pub fn observe(&mut self, token: u32) {
        *self.output_counts.entry(token).or_default() += 1;
    }

    /// Applies penalties and bias in place: the logits logprobs are reported from.
    pub fn process(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let mut seen: Vec<u32> =
                self.prompt_tokens.iter().copied().chain(self.output_counts.keys().copied()).collect();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    // A tiny penalty would divide a logit to +inf, and inf - inf in the softmax is
                    // a NaN that silently picks the last candidate: the largest finite value
                    // keeps the token as the top one instead.
                    *l = if *l > 0.0 { (*l / p.repetition_penalty).min(f32::MAX) } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        for (&t, &b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        if let Some(allowed) = &p.allowed_token_ids {
            // Keep the listed logits, clear the rest: O(vocab + list) whatever the list's size.
            let kept: Vec<(usize, f32)> =
                allowed.iter().filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l))).collect();
            logits.fill(f32::NEG_INFINITY);
            for (t, l) in kept {
                logits[t] = l;
            }
        }
    }

    /// Processes `logits` and draws the next token.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        self.process(logits);
        self.draw(logits)
    }

    /// Like `sample`, but only tokens `allowed` accepts can come out. `None` when no token is
    /// allowed.
    ///
    /// A few draws are tried lazily first (a rejected token is masked and the draw repeated:
    /// equivalent to drawing from the masked distribution, and usually the model's own choice is
    /// allowed). Each draw costs a pass over the vocabulary, so when those fail (a constraint far
    /// from what the model wants, such as a forced `choice` text) the whole vocabulary is masked
    /// in one pass and drawn once, keeping a step O(vocab) instead of O(vocab × rejections).
    pub fn sample_allowed(&mut self, logits: &mut [f32], allowed: impl Fn(u32) -> bool) -> Option<Sampled> {
        const LAZY_DRAWS: usize = 4;
        self.process(logits);
        for _ in 0..LAZY_DRAWS.min(logits.len()) {
            let s = self.draw(logits);
            if logits[s.token as usize] == f32::NEG_INFINITY {
                return None;
            }
            if allowed(s.token) {
                return Some(s);
            }
            logits[s.token as usize] = f32::NEG_INFINITY;
        }
        let mut any = false;
        for (t, l) in logits.iter_mut().enumerate() {
            if *l > f32::NEG_INFINITY {
                if allowed(t as u32) {
                    any = true;
                } else {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        any.then(|| self.draw(logits))
    }

    /// Draws from already processed logits.
    fn draw(&mut self, logits: &[f32]) -> Sampled {
        let lse = log_sum_exp(logits);
        let p = &self.params;
        if p.temperature == 0.0 {
            let token = argmax(logits);
            return Sampled { token, logprob: logits[token as usize] - lse };
        }
        // Candidates sorted by logit, cut by top-k, then turned into a tempered distribution.
        let mut idx: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect();
        if idx.is_empty() {
            return Sampled { token: argmax(logits), logprob: f32::NEG_INFINITY };
        }
        let k = if p.top_k == 0 || p.top_k >= idx.len() { idx.len() } else { p.top_k };
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx.iter().map(|&i| ((logits[i as usize] - max) / p.temperature).exp()).collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        // min-p: drop tokens below min_p times the top probability.
        let mut keep = probs.len();
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
        }
        // top-p: smallest prefix whose mass reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut n = 0;
            for &x in &probs[..keep] {
                acc += x;
                n += 1;
                if acc >= p.top_p {
                    break;
                }
            }
            keep = n.max(1);
        }
        let mass: f32 = probs[..keep].iter().sum();
        let mut r = self.rng.random::<f32>() * mass;
        let mut choice = keep - 1;
        for (i, &x) in probs[..keep].iter().enumerate() {
            if r < x {
                choice = i;
                break;
            }
            r -= x;
        }
        let token = idx[choice];
        Sampled { token, logprob: logits[token as usize] - lse }
    }
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

pub fn log_sum_exp(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + x.iter().map(|&v| (v - max).exp()).sum::<f32>().ln()
}

/// The `n` most likely tokens of `logits` with their log-probabilities (`lse`: the logits'
/// [`log_sum_exp`], which the caller has for its own token), best first.
pub fn top_logprobs(logits: &[f32], n: usize, lse: f32) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return vec![];
    }
    idx.select_nth_unstable_by(n - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx.truncate(n);
    idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    idx.into_iter().map(|i| (i, logits[i as usize] - lse)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_token_ids_limit_every_draw_to_the_list() {
        let logits: Vec<f32> = (0..100).map(|i| i as f32 / 10.0).collect();
        let mut s = Sampler::new(
            SamplingParams { allowed_token_ids: Some(vec![3, 40, 7]), seed: Some(5), ..Default::default() },
            &[],
        );
        for _ in 0..50 {
            assert!([3, 40, 7].contains(&s.sample(&mut logits.clone()).token));
        }
        let mut g =
            Sampler::new(SamplingParams { allowed_token_ids: Some(vec![3, 40, 7]), ..SamplingParams::greedy() }, &[]);
        assert_eq!(g.sample(&mut logits.clone()).token, 40);
    }

    #[test]
    fn sample_allowed_takes_the_best_allowed_token_lazily_or_by_mask() {
        let logits: Vec<f32> = (0..1000).map(|i| i as f32 / 100.0).collect();
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        // The model's favourite is allowed: the lazy path.
        assert_eq!(s.sample_allowed(&mut logits.clone(), |_| true).unwrap().token, 999);
        // Only tokens far down the ranking are allowed: the full mask picks the best of them.
        assert_eq!(s.sample_allowed(&mut logits.clone(), |t| t % 97 == 3).unwrap().token, 973);
        assert!(s.sample_allowed(&mut logits.clone(), |_| false).is_none());
        // Sampled draws only ever return allowed tokens.
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() }, &[]);
        for _ in 0..50 {
            assert_eq!(s.sample_allowed(&mut logits.clone(), |t| t < 10).unwrap().token / 10, 0);
        }
    }

    #[test]
    fn greedy_picks_max_and_seed_reproduces() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 7919) % 101) as f32 / 10.0).collect();
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&mut logits.clone()).token, argmax(&logits));
        let params = SamplingParams { temperature: 1.0, seed: Some(42), ..Default::default() };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone(), &[]);
            (0..20).map(|_| s.sample(&mut logits.clone()).token).collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
    }

    #[test]
    fn top_k_one_is_greedy_and_penalties_apply() {
        let logits = vec![1.0, 3.0, 2.0];
        let mut s = Sampler::new(SamplingParams { top_k: 1, seed: Some(1), ..Default::default() }, &[]);
        for _ in 0..10 {
            assert_eq!(s.sample(&mut logits.clone()).token, 1);
        }
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 2.0, ..SamplingParams::greedy() }, &[]);
        s.observe(1);
        assert_eq!(s.sample(&mut logits.clone()).token, 2);
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() }, &[1]);
        assert_eq!(s.sample(&mut logits.clone()).token, 2); // 3/2 = 1.5 < 2
    }

    #[test]
    fn top_p_and_min_p_restrict_the_choice() {
        let logits = vec![10.0, 0.0, 0.0, 0.0];
        let mut s = Sampler::new(SamplingParams { top_p: 0.5, seed: Some(3), ..Default::default() }, &[]);
        let mut m = Sampler::new(SamplingParams { min_p: 0.5, seed: Some(3), ..Default::default() }, &[]);
        for _ in 0..50 {
            assert_eq!(s.sample(&mut logits.clone()).token, 0);
            assert_eq!(m.sample(&mut logits.clone()).token, 0);
        }
    }
}
