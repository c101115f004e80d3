//! Weighted fair shares of batch slots across tenants, and which tenants' rows sit out a step so
//! that a tenant using little of its share (a light tenant) gets its prompt through quickly.
//!
//! Why deferral: on CPU a step's duration grows with every row in it, so a new request of a quiet
//! tenant admitted next to a flooding tenant's full batch waits for that whole batch's forward
//! before its first token. Its time to first token is then set by the flood, not by its own
//! work. Letting the backlogged tenants' rows (and their new admissions) sit out the one step in
//! which a light tenant's prompt is computed bounds that tenant's TTFT to roughly what it would be
//! alone plus the wait for the step already in flight when it arrives.
//! A tenant is never deferred two steps running, so the flooder loses at most every other step
//! (and in practice one step per quiet prompt).

use std::collections::{HashMap, HashSet};

/// Running sequences per tenant against each active tenant's weighted share of `max_num_seqs`.
pub struct SlotShares<'a> {
    held: HashMap<&'a str, usize>,
    /// Running plus waiting sequences.
    demand: HashMap<&'a str, usize>,
    weight: HashMap<&'a str, f64>,
    total_weight: f64,
    slots: usize,
}

impl<'a> SlotShares<'a> {
    /// `running` and `waiting` give (tenant, weight) per sequence. Active tenants are those with
    /// a running or waiting sequence; an idle tenant claims no share.
    pub fn new(
        running: impl IntoIterator<Item = (&'a str, f64)>,
        waiting: impl IntoIterator<Item = (&'a str, f64)>,
        slots: usize,
    ) -> Self {
        let mut held: HashMap<&str, usize> = HashMap::new();
        let mut demand: HashMap<&str, usize> = HashMap::new();
        let mut weight: HashMap<&str, f64> = HashMap::new();
        let mut note = |t: &'a str, w: f64| {
            // Weights come with each request (from the tenant's config); the largest seen wins,
            // so one odd request cannot shrink its tenant's share.
            let e = weight.entry(t).or_insert(0.0);
            *e = e.max(w.max(1e-6));
            *demand.entry(t).or_default() += 1;
        };
        for (t, w) in running {
            *held.entry(t).or_default() += 1;
            note(t, w);
        }
        for (t, w) in waiting {
            note(t, w);
        }
        let total_weight = weight.values().sum::<f64>().max(1e-6);
        Self { held, demand, weight, total_weight, slots }
    }

    pub fn held(&self, tenant: &str) -> usize {
        self.held.get(tenant).copied().unwrap_or(0)
    }

    /// The tenant's weighted fair share of batch slots (fractional).
    pub fn share(&self, tenant: &str) -> f64 {
        self.slots as f64 * self.weight.get(tenant).copied().unwrap_or(0.0) / self.total_weight
    }

    /// Uses less than half its share: the tenants whose prompts are sped up. (Tenants near
    /// their share, e.g. two flooding tenants, take turns through admission order alone;
    /// deferring each other would cost throughput for no latency gain.)
    pub fn light(&self, tenant: &str) -> bool {
        (self.held(tenant) as f64) < self.share(tenant) / 2.0
    }

    fn per_weight(&self, tenant: &str) -> f64 {
        self.held(tenant) as f64 / self.weight.get(tenant).copied().unwrap_or(1.0)
    }

    /// Tenants whose rows sit out this step: when a light tenant has a prompt to compute
    /// (`prefilling` lists the tenants with one), every tenant that holds more slots per weight
    /// than it and wants more than its share (running plus waiting: a backlog, e.g. a flood),
    /// except those that sat out the previous step (`deferred_last`), so nobody is held back
    /// two steps in a row. A flooder that momentarily holds less than its share (several of its
    /// requests just finished) still yields, or its fresh prompts would join the light
    /// tenant's step.
    pub fn deferred<'b>(
        &self,
        prefilling: impl IntoIterator<Item = &'b str>,
        deferred_last: &HashSet<String>,
    ) -> HashSet<String> {
        let Some(bar) = prefilling.into_iter().filter(|t| self.light(t)).map(|t| self.per_weight(t)).reduce(f64::max)
        else {
            return HashSet::new();
        };
        self.held
            .keys()
            .filter(|t| {
                self.per_weight(t) > bar
                    && self.demand.get(**t).copied().unwrap_or(0) as f64 > self.share(t)
                    && !deferred_last.contains(**t)
            })
            .map(|t| t.to_string())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flood_and_quiet(flood_running: usize, quiet_running: usize, quiet_weight: f64) -> SlotShares<'static> {
        let running = std::iter::repeat_n(("flood", 1.0), flood_running)
            .chain(std::iter::repeat_n(("quiet", quiet_weight), quiet_running));
        let waiting = std::iter::repeat_n(("flood", 1.0), 50).chain([("quiet", quiet_weight)]);
        SlotShares::new(running.collect::<Vec<_>>(), waiting.collect::<Vec<_>>(), 8)
    }

    #[test]
    fn shares_follow_weights_of_active_tenants() {
        let s = flood_and_quiet(7, 0, 1.0);
        assert_eq!(s.share("flood"), 4.0);
        assert_eq!(s.share("quiet"), 4.0);
        assert_eq!(s.share("idle"), 0.0, "a tenant with nothing queued claims no share");
        let s = flood_and_quiet(7, 0, 3.0);
        assert_eq!(s.share("quiet"), 6.0);
        assert!(s.light("quiet") && !s.light("flood"));
    }

    #[test]
    fn flooder_sits_out_the_quiet_tenants_prefill_but_never_two_steps_running() {
        let s = flood_and_quiet(7, 1, 1.0);
        let none = HashSet::new();
        assert_eq!(s.deferred(["quiet"], &none), HashSet::from(["flood".to_string()]));
        // The flooder below its share (some of its requests just finished) still yields.
        let dipped = flood_and_quiet(3, 0, 1.0);
        assert_eq!(dipped.deferred(["quiet"], &none), HashSet::from(["flood".to_string()]));
        // A quiet tenant already using half its share is not light.
        assert!(flood_and_quiet(6, 2, 1.0).deferred(["quiet"], &none).is_empty());
        // Only the flooder itself has prompts to compute: nobody is held back.
        assert!(s.deferred(["flood"], &none).is_empty());
        // Deferred in the previous step: runs in this one whatever is waiting.
        assert!(s.deferred(["quiet"], &HashSet::from(["flood".to_string()])).is_empty());
    }

    #[test]
    fn tenants_at_their_share_are_not_deferred() {
        let running = [("a", 1.0); 4].into_iter().chain([("b", 1.0); 4]);
        let s = SlotShares::new(running.collect::<Vec<_>>(), [("a", 1.0), ("b", 1.0)], 8);
        assert!(s.deferred(["a", "b"], &HashSet::new()).is_empty(), "two tenants at their share defer nobody");
        // Two flooders: one dipping below its share does not make the other sit out.
        let running = [("a", 1.0); 5].into_iter().chain([("b", 1.0); 3]);
        let s = SlotShares::new(
            running.collect::<Vec<_>>(),
            [("a", 1.0); 20].into_iter().chain([("b", 1.0); 20]).collect::<Vec<_>>(),
            8,
        );
        assert!(s.deferred(["b"], &HashSet::new()).is_empty());
        // A tenant holding more than the light one but wanting no more than its share runs on.
        let s = SlotShares::new([("a", 1.0); 3], [("q", 1.0)], 8);
        assert!(s.light("q") && s.deferred(["q"], &HashSet::new()).is_empty());
        // A single tenant holds every slot it likes.
        let s = SlotShares::new([("", 1.0); 8], [("", 1.0)], 8);
        assert!(s.deferred([""], &HashSet::new()).is_empty());
    }
}
