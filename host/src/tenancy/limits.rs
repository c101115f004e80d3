//! The rate limiter: per scope (a tenant, an API key) sliding one-minute windows of admitted
//! requests and reserved tokens, a concurrency count and a token budget over a fixed reset
//! window. One mutex guards every scope, so a request is checked against all its scopes and
//! admitted (or refused) in one step: concurrent requests can never over-admit.
//!
//! Tokens are reserved at admission (prompt + the most the request may generate) and settled to
//! the real count when it ends; a request refused by the engine is refunded in full.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Limits of one scope; `None` is unlimited.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Requests per minute.
    pub rpm: Option<u64>,
    /// Tokens (prompt + completion) per minute.
    pub tpm: Option<u64>,
    pub max_concurrent: Option<u64>,
    /// Prompt + completion tokens of one sequence at most.
    pub max_context: Option<u64>,
    /// Tokens per budget window.
    pub token_budget: Option<u64>,
    /// Length of the budget window in seconds (fixed windows aligned to the Unix epoch);
    /// default one day.
    pub budget_window_secs: Option<u64>,
}

pub const DEFAULT_BUDGET_WINDOW_SECS: u64 = 86_400;
const MINUTE: Duration = Duration::from_secs(60);

impl Limits {
    pub fn budget_window(&self) -> u64 {
        self.budget_window_secs.filter(|&w| w > 0).unwrap_or(DEFAULT_BUDGET_WINDOW_SECS)
    }

    /// Start (Unix seconds) of the budget window containing `now`.
    pub fn budget_window_start(&self, now_unix: u64) -> u64 {
        let w = self.budget_window();
        now_unix - now_unix % w
    }
}

/// One scope to check a request against.
pub struct Scope<'a> {
    /// Unique across scopes, e.g. `tenant:acme` or `key:1a2b`.
    pub id: String,
    pub limits: &'a Limits,
    /// Tokens already used in the current budget window according to the usage table, used
    /// when the limiter first sees this scope in this window (after a restart).
    pub budget_used: u64,
}

#[derive(Default)]
struct Window {
    /// Admission times within the last minute.
    requests: VecDeque<Instant>,
    /// (admission time, reservation id, tokens) within the last minute.
    tokens: VecDeque<(Instant, u64, u64)>,
    tokens_sum: u64,
    concurrent: u64,
    budget_start: u64,
    budget_used: u64,
    budget_loaded: bool,
}

impl Window {
    fn expire(&mut self, now: Instant) {
        while self.requests.front().is_some_and(|&t| now.duration_since(t) >= MINUTE) {
            self.requests.pop_front();
        }
        while let Some(&(t, _, n)) = self.tokens.front() {
            if now.duration_since(t) < MINUTE {
                break;
            }
            self.tokens_sum -= n;
            self.tokens.pop_front();
        }
    }

    fn roll_budget(&mut self, limits: &Limits, now_unix: u64, seed: u64) {
        let start = limits.budget_window_start(now_unix);
        if !self.budget_loaded {
            self.budget_loaded = true;
            self.budget_start = start;
            self.budget_used = seed;
        } else if start != self.budget_start {
            self.budget_start = start;
            self.budget_used = 0;
        }
    }
}

/// The wait of a request no wait can admit (larger than a limit's whole window).
pub const NEVER: Duration = Duration::MAX;

/// Why a request was refused, with what the 429 says.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    pub message: String,
    /// Seconds until a retry may succeed ([`NEVER`] when none can).
    pub retry_after: Duration,
    pub status: RateStatus,
}

impl Refusal {
    /// Whether retrying can never succeed: the request alone exceeds a limit.
    pub fn is_permanent(&self) -> bool {
        self.retry_after == NEVER
    }
}

/// What the `x-ratelimit-*` headers report: the tightest of the request's scopes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RateStatus {
    pub requests: Option<Gauge>,
    pub tokens: Option<Gauge>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Gauge {
    pub limit: u64,
    pub remaining: u64,
    /// Until the window has room for one more request / frees all its tokens.
    pub reset: Duration,
}

impl RateStatus {
    fn merge_requests(&mut self, g: Gauge) {
        if self.requests.as_ref().is_none_or(|o| g.remaining < o.remaining) {
            self.requests = Some(g);
        }
    }
    fn merge_tokens(&mut self, g: Gauge) {
        if self.tokens.as_ref().is_none_or(|o| g.remaining < o.remaining) {
            self.tokens = Some(g);
        }
    }

    /// The OpenAI header set.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(g) = &self.requests {
            h.push(("x-ratelimit-limit-requests", g.limit.to_string()));
            h.push(("x-ratelimit-remaining-requests", g.remaining.to_string()));
            h.push(("x-ratelimit-reset-requests", format_duration(g.reset)));
        }
        if let Some(g) = &self.tokens {
            h.push(("x-ratelimit-limit-tokens", g.limit.to_string()));
            h.push(("x-ratelimit-remaining-tokens", g.remaining.to_string()));
            h.push(("x-ratelimit-reset-tokens", format_duration(g.reset)));
        }
        h
    }
}

/// OpenAI's reset format: `20ms`, `1.5s`, `6m0s`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = ms as f64 / 1000.0;
        if ms.is_multiple_of(1000) {
            format!("{}s", ms / 1000)
        } else {
            format!("{}s", format!("{s:.3}").trim_end_matches('0'))
        }
    } else {
        format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000)
    }
}

#[derive(Default)]
pub struct Limiter {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    windows: HashMap<String, Window>,
    next_id: u64,
}

impl Inner {
    /// Checks a request reserving `tokens` against every scope's limits, changing nothing but
    /// the windows' expiry: the tightest gauges (for the `x-ratelimit-*` headers) and, if a limit
    /// refuses it, the refusal with the longest wait. `tokens: None` asks about any request
    /// whatever its size: token rates are not checked, and the budget as for one token.
    fn evaluate(
        &mut self,
        scopes: &[Scope],
        tokens: Option<u64>,
        now: Instant,
        now_unix: u64,
    ) -> (RateStatus, Option<(String, Duration)>) {
        let mut status = RateStatus::default();
        let mut refusal: Option<(String, Duration)> = None;
        let mut refuse = |msg: String, wait: Duration| {
            if refusal.as_ref().is_none_or(|(_, w)| wait > *w) {
                refusal = Some((msg, wait));
            }
        };
        for sc in scopes {
            let w = self.current_window(sc, now, now_unix);
            let (l, what) = (sc.limits, sc.kind());
            if let Some(rpm) = l.rpm {
                let used = w.requests.len() as u64;
                let reset = w.requests.front().map_or(MINUTE, |&t| MINUTE.saturating_sub(now.duration_since(t)));
                if used >= rpm {
                    // Room again once the admission that keeps the window full leaves it (never,
                    // for a limit of 0: say a minute, like any other full window).
                    let wait = w
                        .requests
                        .get((used - rpm) as usize)
                        .map_or(MINUTE, |&t| MINUTE.saturating_sub(now.duration_since(t)));
                    refuse(format!("Rate limit reached for requests: {what} limit {rpm} requests per minute"), wait);
                }
                status.merge_requests(Gauge { limit: rpm, remaining: rpm.saturating_sub(used + 1), reset });
            }
            if let (Some(tpm), Some(tokens)) = (l.tpm, tokens) {
                let used = w.tokens_sum;
                if tokens > tpm {
                    refuse(format!("Request too large: it may use {tokens} tokens, more than the {what} limit of {tpm} tokens per minute"), NEVER);
                } else if used.saturating_add(tokens) > tpm {
                    // Wait until enough reserved tokens leave the window.
                    let need = used.saturating_add(tokens) - tpm;
                    let mut freed = 0;
                    let mut wait = MINUTE;
                    for &(t, _, n) in &w.tokens {
                        freed += n;
                        if freed >= need {
                            wait = MINUTE.saturating_sub(now.duration_since(t));
                            break;
                        }
                    }
                    refuse(format!("Rate limit reached for tokens: {what} limit {tpm} tokens per minute, {used} in use, this request needs {tokens}"), wait);
                }
                let reset = if tokens > 0 {
                    MINUTE
                } else {
                    w.tokens.back().map_or(Duration::ZERO, |&(t, _, _)| MINUTE.saturating_sub(now.duration_since(t)))
                };
                status.merge_tokens(Gauge {
                    limit: tpm,
                    remaining: tpm.saturating_sub(used.saturating_add(tokens)),
                    reset,
                });
            }
            if let Some(mc) = l.max_concurrent {
                if w.concurrent >= mc {
                    refuse(format!("Too many concurrent requests: {what} limit {mc}"), Duration::from_secs(1));
                }
            }
            if let Some(b) = l.token_budget {
                // Every request has at least one prompt token.
                if tokens.is_some_and(|t| t > b) {
                    refuse(
                        format!(
                            "Request too large: it may use {} tokens, more than the {what} budget of {b} tokens per {}s window",
                            tokens.unwrap_or(0),
                            l.budget_window()
                        ),
                        NEVER,
                    );
                } else if w.budget_used.saturating_add(tokens.unwrap_or(1)) > b {
                    let end = w.budget_start + l.budget_window();
                    refuse(
                        format!(
                            "Token budget exhausted: {what} budget {b} tokens per {}s window, {} used",
                            l.budget_window(),
                            w.budget_used
                        ),
                        Duration::from_secs(end.saturating_sub(now_unix).max(1)),
                    );
                }
            }
        }
        (status, refusal)
    }

    /// `sc`'s window brought up to `now`: old admissions expired, the budget window rolled.
    fn current_window(&mut self, sc: &Scope, now: Instant, now_unix: u64) -> &mut Window {
        let w = self.windows.entry(sc.id.clone()).or_default();
        w.expire(now);
        w.roll_budget(sc.limits, now_unix, sc.budget_used);
        w
    }
}

impl Scope<'_> {
    /// `tenant` or `key`, for messages.
    fn kind(&self) -> &str {
        self.id.split(':').next().unwrap_or("scope")
    }
}

/// An admitted request's hold on its scopes: counted as concurrent until settled (or dropped,
/// which refunds the whole reservation).
pub struct Reservation {
    limiter: Arc<Limiter>,
    scopes: Vec<String>,
    id: u64,
    reserved: u64,
    pub status: RateStatus,
    done: bool,
}

impl Limiter {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Admits a request reserving `tokens` against every scope, or refuses it without changing
    /// anything.
    pub fn admit(
        self: &Arc<Self>,
        scopes: &[Scope],
        tokens: u64,
        now: Instant,
        now_unix: u64,
    ) -> Result<Reservation, Refusal> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (status, refusal) = inner.evaluate(scopes, Some(tokens), now, now_unix);
        if let Some((message, retry_after)) = refusal {
            return Err(Refusal { message, retry_after, status });
        }
        inner.next_id += 1;
        let id = inner.next_id;
        for sc in scopes {
            let w = inner.windows.get_mut(&sc.id).expect("window created above");
            w.requests.push_back(now);
            w.tokens.push_back((now, id, tokens));
            w.tokens_sum += tokens;
            w.concurrent += 1;
            w.budget_used += tokens;
        }
        Ok(Reservation {
            limiter: self.clone(),
            scopes: scopes.iter().map(|s| s.id.clone()).collect(),
            id,
            reserved: tokens,
            status,
            done: false,
        })
    }

    /// Refuses early, without reserving anything, a request that `admit` would refuse whatever
    /// its size: a full request window, every concurrency slot taken, or a spent token budget.
    /// Callers use it before the costly part of a request (tokenizing, rendering the chat
    /// template) so that a key at its limits, or switched off with rpm 0, cannot make the
    /// server do that work. `admit` still decides: this only answers sooner.
    pub fn precheck(&self, scopes: &[Scope], now: Instant, now_unix: u64) -> Result<(), Refusal> {
        let (status, refusal) =
            self.inner.lock().unwrap_or_else(|e| e.into_inner()).evaluate(scopes, None, now, now_unix);
        refusal.map_or(Ok(()), |(message, retry_after)| Err(Refusal { message, retry_after, status }))
    }

    /// Whether the limiter already tracks `scope`'s budget window starting at `window_start`
    /// (then the usage table need not be summed to seed it).
    pub fn budget_seeded(&self, scope: &str, window_start: u64) -> bool {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.windows.get(scope).is_some_and(|w| w.budget_loaded && w.budget_start == window_start)
    }

    /// Requests counted as concurrent in `scope` (for tests and metrics).
    pub fn concurrent(&self, scope: &str) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).windows.get(scope).map_or(0, |w| w.concurrent)
    }

    fn release(&self, r: &Reservation, actual: Option<u64>) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for sc in &r.scopes {
            let Some(w) = inner.windows.get_mut(sc) else { continue };
            w.concurrent = w.concurrent.saturating_sub(1);
            let new = actual.unwrap_or(0);
            if let Some(e) = w.tokens.iter_mut().find(|e| e.1 == r.id) {
                w.tokens_sum = w.tokens_sum - e.2 + new;
                e.2 = new;
            }
            w.budget_used = (w.budget_used + new).saturating_sub(r.reserved);
            if actual.is_none() {
                // Refused downstream: the request does not count against the request rate.
                if let Some(pos) = w.tokens.iter().position(|e| e.1 == r.id) {
                    let t = w.tokens[pos].0;
                    w.tokens.remove(pos);
                    if let Some(p) = w.requests.iter().rposition(|&x| x == t) {
                        w.requests.remove(p);
                    }
                }
            }
        }
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("scopes", &self.scopes)
            .field("id", &self.id)
            .field("reserved", &self.reserved)
            .finish()
    }
}

impl Reservation {
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The request ended having used `tokens`: the reservation becomes the real count.
    pub fn settle(mut self, tokens: u64) {
        self.done = true;
        self.limiter.release(&self, Some(tokens));
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.done {
            self.limiter.release(self, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(id: &str, l: &Limits) -> Scope<'static> {
        Scope { id: id.into(), limits: Box::leak(Box::new(l.clone())), budget_used: 0 }
    }

    #[test]
    fn precheck_refuses_what_admit_would_refuse_whatever_the_size_and_reserves_nothing() {
        let lim = Limiter::new();
        let t0 = Instant::now();
        let l = Limits { rpm: Some(2), max_concurrent: Some(5), tpm: Some(10), ..Default::default() };
        // Token limits are not its business: a request too large for tpm passes the precheck.
        assert!(lim.precheck(&[scope("t:a", &l)], t0, 0).is_ok());
        let a = lim.admit(&[scope("t:a", &l)], 3, t0, 0).unwrap();
        assert!(lim.precheck(&[scope("t:a", &l)], t0, 0).is_ok());
        assert_eq!(lim.concurrent("t:a"), 1, "the precheck reserves nothing");
        let _b = lim.admit(&[scope("t:a", &l)], 3, t0, 0).unwrap();
        let e = lim.precheck(&[scope("t:a", &l)], t0 + Duration::from_secs(10), 0).unwrap_err();
        assert!(e.message.contains("requests"), "{}", e.message);
        assert_eq!(e.retry_after, Duration::from_secs(50));
        assert_eq!(e.status.requests.as_ref().unwrap().remaining, 0);
        // Once the window moves on it passes again; an rpm of 0 never does.
        a.settle(3);
        assert!(lim.precheck(&[scope("t:a", &l)], t0 + MINUTE, 0).is_ok());
        let off = Limits { rpm: Some(0), ..Default::default() };
        assert!(lim.precheck(&[scope("t:off", &off)], t0, 0).is_err());
        // A full concurrency count, and a spent budget, refuse too.
        let one = Limits { max_concurrent: Some(1), ..Default::default() };
        let held = lim.admit(&[scope("t:c", &one)], 0, t0, 0).unwrap();
        assert!(lim.precheck(&[scope("t:c", &one)], t0, 0).unwrap_err().message.contains("concurrent"));
        drop(held);
        assert!(lim.precheck(&[scope("t:c", &one)], t0, 0).is_ok());
        let budget = Limits { token_budget: Some(100), ..Default::default() };
        let spent = Scope { id: "t:b".into(), limits: &budget, budget_used: 100 };
        assert!(lim.precheck(&[spent], t0, 0).unwrap_err().message.contains("budget"));
    }

    #[test]
    fn rpm_admits_exactly_the_limit_per_minute() {
        let lim = Limiter::new();
        let l = Limits { rpm: Some(3), ..Default::default() };
        let t0 = Instant::now();
        let mut held = Vec::new();
        for i in 0..3 {
            let r = lim.admit(&[scope("t:a", &l)], 0, t0, 0).unwrap();
            assert_eq!(r.status.requests.as_ref().unwrap().remaining, 2 - i);
            held.push(r);
        }
        let e = lim.admit(&[scope("t:a", &l)], 0, t0, 0).unwrap_err();
        assert!(e.retry_after > Duration::from_secs(59));
        // Settling does not give the request back; a minute later there is room again.
        held.into_iter().for_each(|r| r.settle(0));
        assert!(lim.admit(&[scope("t:a", &l)], 0, t0 + Duration::from_secs(30), 0).is_err());
        assert!(lim.admit(&[scope("t:a", &l)], 0, t0 + MINUTE, 0).is_ok());
    }

    /// Limits of 0 refuse every request (a key switched off), and a request's token estimate near
    /// u64::MAX is refused rather than overflowing the sums.
    #[test]
    fn zero_limits_and_huge_estimates_are_refusals() {
        let lim = Limiter::new();
        let t0 = Instant::now();
        for l in [
            Limits { rpm: Some(0), ..Default::default() },
            Limits { tpm: Some(0), ..Default::default() },
            Limits { max_concurrent: Some(0), ..Default::default() },
            Limits { token_budget: Some(0), ..Default::default() },
        ] {
            let e = lim.admit(&[scope("t:zero", &l)], 1, t0, 0).unwrap_err();
            assert!(e.retry_after > Duration::ZERO, "{l:?}: {}", e.message);
        }
        let l = Limits { tpm: Some(100), token_budget: Some(100), ..Default::default() };
        lim.admit(&[scope("t:big", &l)], 10, t0, 0).unwrap().settle(10);
        assert!(lim.admit(&[scope("t:big", &l)], u64::MAX - 5, t0, 0).is_err());
    }

    #[test]
    fn tpm_reserves_then_settles_and_refunds() {
        let lim = Limiter::new();
        let l = Limits { tpm: Some(100), ..Default::default() };
        let t0 = Instant::now();
        let a = lim.admit(&[scope("t:a", &l)], 60, t0, 0).unwrap();
        assert!(lim.admit(&[scope("t:a", &l)], 50, t0, 0).is_err(), "60 + 50 > 100");
        a.settle(20);
        let b = lim.admit(&[scope("t:a", &l)], 50, t0, 0).unwrap();
        assert_eq!(b.status.tokens.as_ref().unwrap().remaining, 30);
        drop(b); // refused by the engine: refunded
        let c = lim.admit(&[scope("t:a", &l)], 80, t0, 0).unwrap();
        assert_eq!(c.status.tokens.as_ref().unwrap().remaining, 0);
        // Larger than the whole limit: refused outright.
        assert!(lim.admit(&[scope("t:b", &l)], 101, t0, 0).unwrap_err().message.contains("too large"));
    }

    #[test]
    fn concurrency_and_all_scopes_checked_together() {
        let lim = Limiter::new();
        let tenant = Limits { max_concurrent: Some(2), ..Default::default() };
        let key = Limits { rpm: Some(1), ..Default::default() };
        let t0 = Instant::now();
        let a = lim.admit(&[scope("tenant:x", &tenant), scope("key:1", &key)], 0, t0, 0).unwrap();
        // key:1 is out of requests; the refusal must not count against tenant:x.
        assert!(lim.admit(&[scope("tenant:x", &tenant), scope("key:1", &key)], 0, t0, 0).is_err());
        assert_eq!(lim.concurrent("tenant:x"), 1);
        let b = lim.admit(&[scope("tenant:x", &tenant), scope("key:2", &key)], 0, t0, 0).unwrap();
        assert!(lim
            .admit(&[scope("tenant:x", &tenant), scope("key:3", &key)], 0, t0, 0)
            .unwrap_err()
            .message
            .contains("concurrent"));
        a.settle(0);
        b.settle(0);
        assert_eq!(lim.concurrent("tenant:x"), 0);
    }

    #[test]
    fn budget_seeds_from_history_and_resets_with_the_window() {
        let lim = Limiter::new();
        let l = Limits { token_budget: Some(100), budget_window_secs: Some(3600), ..Default::default() };
        let t0 = Instant::now();
        let sc = |used| Scope { id: "t:a".into(), limits: &l, budget_used: used };
        let e = lim.admit(&[sc(90)], 20, t0, 7200).unwrap_err();
        assert_eq!(e.retry_after, Duration::from_secs(3600));
        lim.admit(&[sc(90)], 10, t0, 7200).unwrap().settle(10);
        assert!(lim.admit(&[sc(0)], 1, t0, 7300).is_err(), "the seed is only read once per window");
        assert!(lim.admit(&[sc(0)], 100, t0, 10_800).is_ok(), "a new window starts empty");
    }

    #[test]
    fn concurrent_threads_never_over_admit() {
        let lim = Limiter::new();
        let l = Limits { rpm: Some(37), tpm: Some(1000), ..Default::default() };
        let t0 = Instant::now();
        let admitted = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..20 {
                        if let Ok(r) = lim.admit(&[Scope { id: "t:a".into(), limits: &l, budget_used: 0 }], 10, t0, 0) {
                            admitted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            r.settle(10);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.into_inner(), 37);
    }

    #[test]
    fn durations_format_like_openai() {
        assert_eq!(format_duration(Duration::from_millis(20)), "20ms");
        assert_eq!(format_duration(Duration::from_secs(1)), "1s");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_duration(Duration::from_secs(360)), "6m0s");
    }
}
