use super::*;
use proptest::prelude::*;

const SEC: u64 = 1_000_000;

fn log(limit: u64, window: u64) -> SlidingLog {
    SlidingLog::new(limit, window).unwrap()
}

/// Check, then record if admitted.
fn step(alg: &SlidingLog, s: &mut SlidingLogState, now: u64, cost: u64) -> (Decision, Hold) {
    let d = alg.check(s, now, cost);
    let hold = if d.admitted {
        alg.record(s, now, cost)
    } else {
        Hold::default()
    };
    (d, hold)
}

fn touched<R>(f: impl FnOnce() -> R) -> (R, u64) {
    TOUCHED.with(|c| c.set(0));
    let r = f();
    (r, TOUCHED.with(|c| c.get()))
}

#[cfg(target_pointer_width = "64")]
#[test]
fn state_layout_is_packed() {
    assert_eq!(std::mem::size_of::<(u32, u32)>(), 8);
    assert_eq!(std::mem::size_of::<Entries>(), 48);
    assert_eq!(std::mem::size_of::<SlidingLogState>(), 80);
}

proptest! {
    /// Entries read back as a plain ring of `(u64, u64)` whatever they
    /// went through: one entry, packed, packed again from a later front
    /// (times more than 2^32 µs apart, costs over 2^32), widened.
    #[test]
    fn entries_read_as_a_plain_ring(
        ops in proptest::collection::vec(
            (0u8..4, prop_oneof![0u64..1000, 0u64..1 << 33], prop_oneof![0u64..10, 0u64..1 << 33]),
            1..120,
        ),
    ) {
        let mut entries = Entries::default();
        let mut model: VecDeque<(u64, u64)> = VecDeque::new();
        let (mut now, mut cum) = (1u64 << 50, u64::MAX - 20);
        for (op, a, b) in ops {
            match op {
                0 | 1 => {
                    now += a;
                    cum = cum.wrapping_add(b);
                    entries.push((now, cum));
                    model.push_back((now, cum));
                }
                2 if model.len() > 1 => {
                    let k = (a as usize) % model.len();
                    entries.drain_front(k);
                    model.drain(..k);
                }
                3 if !model.is_empty() => {
                    let i = (a as usize) % model.len();
                    let before = match i.checked_sub(1) {
                        Some(p) => model[p].1,
                        None => model[0].1.wrapping_sub(b.min(1000)),
                    };
                    let take = b.min(model[i].1.wrapping_sub(before));
                    entries.lower_from(i, take);
                    for entry in model.range_mut(i..) {
                        entry.1 = entry.1.wrapping_sub(take);
                    }
                    cum = model.back().map_or(cum, |e| e.1);
                }
                _ => {}
            }
            prop_assert_eq!(entries.len(), model.len());
            for (i, entry) in model.iter().enumerate() {
                prop_assert_eq!(entries.get(i), Some(*entry));
            }
        }
    }
}

#[test]
fn new_names_the_field() {
    assert_eq!(SlidingLog::new(0, 1).unwrap_err().field(), "limit");
    assert_eq!(SlidingLog::new(1, 0).unwrap_err().field(), "window");
    // One entry per admission: the limit bounds a key's entries.
    assert!(SlidingLog::new(SlidingLog::MAX_LIMIT, 1).is_ok());
    let over = SlidingLog::new(SlidingLog::MAX_LIMIT + 1, 1).unwrap_err();
    assert_eq!(over.field(), "limit");
    assert!(over.to_string().contains("at most 1,000,000"), "{over}");
    #[cfg(feature = "redis")]
    {
        assert!(log(1_000_000, 366 * 24 * 3600 * SEC).lua_exact().is_ok());
        assert_eq!(
            log(1, LUA_MAX + 1).lua_exact().unwrap_err().field(),
            "window"
        );
        assert_eq!(log(7, 9).script_args(), [7, 9, 0]);
    }
    assert_eq!(log(7, 9).share(2), log(3, 9));
    assert_eq!(log(7, 9).share(100), log(1, 9));
}

#[test]
fn exactly_100_in_any_window_across_a_boundary_burst() {
    // 100 per 60 s; bursts of 150 just before and at every boundary.
    let alg = log(100, 60 * SEC);
    let mut s = SlidingLogState::default();
    let t0 = 1_000 * SEC;
    let mut admitted = Vec::new();
    for k in 0..5 {
        for at in [t0 + k * 60 * SEC - 1_000, t0 + k * 60 * SEC] {
            for _ in 0..150 {
                if step(&alg, &mut s, at, 1).0.admitted {
                    admitted.push(at);
                }
            }
        }
    }
    // Exactly 100 in the first burst, then 100 each time the previous
    // hundred has left the window, never more.
    assert_eq!(admitted.len(), 500);
    for &t in &admitted {
        let n = admitted
            .iter()
            .filter(|&&a| a + 60 * SEC > t && a <= t)
            .count();
        assert!(n <= 100, "{n} admitted in the window ending at {t}");
    }
    assert_eq!(admitted.iter().filter(|&&a| a == t0 - 1_000).count(), 100);
    assert_eq!(admitted.iter().filter(|&&a| a == t0).count(), 0);
    // The wait at the boundary is exact: until the burst leaves.
    let d = alg.check(&mut s.clone(), t0 + 4 * 60 * SEC, 1);
    assert_eq!(d.retry_after, Some(micros(60 * SEC - 1_000)));
}

#[test]
fn refund_reduces_the_charge_own_entry() {
    // 20 per 10 s: A 10 at 0, B 10 at 4 s, A refunded 10 at 5 s.
    let alg = log(20, 10 * SEC);
    let mut s = SlidingLogState::default();
    let (_, a) = step(&alg, &mut s, 0, 10);
    let (_, b) = step(&alg, &mut s, 4 * SEC, 10);
    assert_eq!(a.amount, 10);
    assert_eq!(b.mark, a.mark + 1);
    let a = alg.settle(&mut s, 5 * SEC, a, -10);
    assert_eq!(a.amount, 0);
    // A's entry gave the 10 back, not B's: B still holds 10 in (0, 10 s].
    let c = alg.check(&mut s.clone(), 10 * SEC, 20);
    assert!(!c.admitted);
    assert_eq!(c.retry_after, Some(micros(4 * SEC)));
    assert!(step(&alg, &mut s, 10 * SEC, 10).0.admitted);
    // The spent hold gives nothing more; B's hold gives back B's cost.
    assert_eq!(alg.settle(&mut s, 10 * SEC, a, -10), a);
    assert_eq!(alg.settle(&mut s, 10 * SEC, b, -15).amount, 0);
    assert_eq!(alg.check(&mut s, 10 * SEC, 0).remaining, 10);
}

#[test]
fn refund_after_the_entry_left_gives_nothing() {
    let alg = log(5, 10);
    let mut s = SlidingLogState::default();
    let (_, h) = step(&alg, &mut s, 100, 5);
    // The entry leaves at 110; the key is fresh and starts a new life.
    assert_eq!(alg.fresh_at(&s), 110);
    let (_, h2) = step(&alg, &mut s, 115, 5);
    assert!(h2.mark > h.mark);
    assert_eq!(alg.settle(&mut s, 116, h, -5), h);
    assert_eq!(alg.check(&mut s, 116, 0).remaining, 0);
    // A hold from an evicted state never names the new life's entries.
    let mut fresh = SlidingLogState::default();
    let (_, h3) = step(&alg, &mut fresh, 1_000, 5);
    assert!(h3.mark >= 1_000);
    assert_eq!(alg.settle(&mut fresh, 1_001, h2, -5), h2);
    assert_eq!(alg.check(&mut fresh, 1_001, 0).remaining, 0);
}

#[test]
fn extra_charge_is_capped_and_not_refundable() {
    let alg = log(10, 100);
    let mut s = SlidingLogState::default();
    let (_, h) = step(&alg, &mut s, 1_000, 4);
    assert_eq!(alg.settle(&mut s, 1_010, h, 1_000), h);
    assert_eq!(alg.check(&mut s, 1_010, 0).remaining, 0);
    // The refund gives back the charge's 4, never the extra 6.
    assert_eq!(alg.settle(&mut s, 1_020, h, -10).amount, 0);
    assert_eq!(alg.check(&mut s, 1_020, 0).remaining, 4);
    // The extra charge leaves W after its own time.
    let d = alg.check(&mut s, 1_020, 5);
    assert_eq!(d.retry_after, Some(micros(90)));
    assert!(alg.check(&mut s, 1_110, 10).admitted);
}

#[test]
fn lowered_limit_and_changed_window_never_underflow() {
    let big = log(100, 100);
    let mut s = SlidingLogState::default();
    for t in 0..50 {
        step(&big, &mut s, 1_000 + t, 2);
    }
    // Limit lowered to 10 under 100 held: nothing until 91 have left.
    let small = log(10, 100);
    let d = small.check(&mut s, 1_050, 1);
    assert_eq!(d.remaining, 0);
    // 91 must leave: the entries through the one at 1_045 (cumulative 92).
    assert_eq!(d.retry_after, Some(micros(1_045 + 100 - 1_050)));
    assert_eq!(small.record(&mut s, 1_050, 1), Hold::default());
    assert!(!small.check(&mut s, 1_144, 1).admitted);
    assert!(small.check(&mut s, 1_145, 1).admitted);
    // A shorter window keeps only what is younger than it; the wait is
    // within the new window.
    let short = log(10, 5);
    assert!(short.check(&mut s, 1_146, 10).admitted);
    let mut s = SlidingLogState::default();
    for t in 0..50 {
        step(&big, &mut s, 1_000 + t, 2);
    }
    let d = short.check(&mut s, 1_049, 10);
    assert_eq!(d.retry_after, Some(micros(5)));
    assert_eq!(s.len(), 5);
}

#[test]
fn fast_paths_read_no_entry() {
    let alg = log(1_000, 1_000);
    let mut s = SlidingLogState::default();
    for t in 0..1_000 {
        step(&alg, &mut s, 10_000 + t, 1);
    }
    // An untrimmed admission check, a cost-1 refusal: no entry read.
    let (d, n) = touched(|| alg.check(&mut s, 10_999, 1));
    assert!(!d.admitted);
    assert_eq!(d.retry_after, Some(micros(1)));
    assert_eq!(n, 0);
    let (d, n) = touched(|| alg.check(&mut s, 10_999, 0));
    assert!(d.admitted);
    assert_eq!(n, 0);
    // Trimming one entry reads a couple.
    let (d, n) = touched(|| alg.check(&mut s, 11_000, 1));
    assert!(d.admitted);
    assert!(n <= 8, "{n}");
    assert_eq!(s.len(), 999);
}

#[test]
fn refusal_on_a_100k_log_touches_o_log_n_entries() {
    let n = 100_000u64;
    let alg = log(n, 10 * n);
    let mut s = SlidingLogState::default();
    let t0 = 5 * n;
    for i in 0..n {
        assert!(step(&alg, &mut s, t0 + i, 1).0.admitted);
    }
    let now = t0 + n;
    for (cost, leaves) in [(n, t0 + n - 1), (n / 2, t0 + n / 2 - 1), (2, t0 + 1)] {
        let (d, reads) = touched(|| alg.check(&mut s, now, cost));
        assert!(!d.admitted);
        assert_eq!(d.retry_after, Some(micros(leaves + 10 * n - now)));
        assert!(reads <= 2 * 17 + 6, "cost {cost}: {reads} entries read");
    }
    // Trimming half the log reads O(log n) entries too.
    let (d, reads) = touched(|| alg.check(&mut s, t0 + 10 * n + n / 2 - 1, 1));
    assert!(d.admitted);
    assert!(reads <= 2 * 17 + 6, "trim: {reads} entries read");
    assert_eq!(s.len() as u64, n / 2);
    // A refund of the newest charge rewrites only itself.
    let newest = Hold {
        mark: s.next_seq() - 1,
        frac: s.newest,
        amount: 1,
        life: 0,
    };
    let (h, reads) = touched(|| alg.settle(&mut s, t0 + 10 * n + n / 2 - 1, newest, -1));
    assert_eq!(h.amount, 0);
    assert!(reads <= 3, "refund: {reads}");
}

/// What the log must do, written naively: every live entry
/// `(time, seq, cost)`, each decision a scan.
#[derive(Debug, Default)]
struct Naive {
    entries: Vec<(u64, u64, u64)>,
    next_seq: u64,
}

impl Naive {
    fn held(&self) -> u64 {
        self.entries.iter().map(|e| e.2).sum()
    }

    fn pop_zeros(&mut self) {
        let k = self.entries.iter().take_while(|e| e.2 == 0).count();
        self.entries.drain(..k);
    }

    fn trim(&mut self, w: u64, now: u64) -> u64 {
        let acting = now.max(self.entries.last().map_or(0, |e| e.0));
        self.entries.retain(|e| e.0.saturating_add(w) > acting);
        self.pop_zeros();
        acting
    }

    fn check(&mut self, a: &SlidingLog, now: u64, cost: u64) -> Decision {
        let (l, w) = (a.limit(), a.window_micros());
        let now = self.trim(w, now);
        let held = self.held();
        let remaining = l.saturating_sub(held);
        let reset = self
            .entries
            .last()
            .map_or(0, |e| e.0.saturating_add(w).saturating_sub(now));
        if cost > l {
            return never(l, remaining, reset);
        }
        // A cost of 0 is admitted even over a lowered limit.
        if cost <= remaining {
            return Decision {
                admitted: true,
                limit: l,
                remaining: remaining - cost,
                retry_after: None,
                reset: micros(if cost > 0 { w } else { reset }),
            };
        }
        let mut left = held;
        let mut wait = 0;
        for e in &self.entries {
            left -= e.2;
            wait = e.0.saturating_add(w).saturating_sub(now).max(1);
            if left.checked_add(cost).is_some_and(|x| x <= l) {
                break;
            }
        }
        Decision {
            admitted: false,
            limit: l,
            remaining,
            retry_after: Some(micros(wait)),
            reset: micros(reset),
        }
    }

    fn push(&mut self, now: u64, cost: u64) -> u64 {
        if self.entries.is_empty() {
            self.next_seq = now.min(SEQ_START_MAX);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.entries.push((now, seq, cost));
        seq
    }

    fn record(&mut self, a: &SlidingLog, now: u64, cost: u64) -> Hold {
        let now = self.trim(a.window_micros(), now);
        let cost = cost.min(a.limit().saturating_sub(self.held()));
        if cost == 0 {
            return Hold::default();
        }
        Hold {
            mark: self.push(now, cost),
            frac: now,
            amount: cost,
            life: 0,
        }
    }

    /// Trims nothing: only the entries inside the window count.
    fn settle(&mut self, a: &SlidingLog, now: u64, hold: Hold, delta: i64) -> Hold {
        let w = a.window_micros();
        let now = now.max(self.entries.last().map_or(0, |e| e.0));
        let inside = |e: &(u64, u64, u64)| e.0.saturating_add(w) > now;
        if delta > 0 {
            let held: u64 = self.entries.iter().filter(|e| inside(e)).map(|e| e.2).sum();
            let add = delta.unsigned_abs().min(a.limit().saturating_sub(held));
            if add > 0 {
                self.push(now, add);
            }
            return hold;
        }
        let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.1 == hold.mark && e.0 == hold.frac && inside(e))
        else {
            return hold;
        };
        let take = delta.unsigned_abs().min(hold.amount).min(e.2);
        e.2 -= take;
        self.pop_zeros();
        Hold {
            amount: hold.amount - take,
            ..hold
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Decide { dt: u64, cost: u64 },
    Refund { dt: u64, which: usize, amount: u64 },
    Extra { dt: u64, which: usize, amount: u64 },
}

fn ops(window: u64, limit: u64) -> impl Strategy<Value = Vec<Op>> {
    let dt = prop_oneof![3 => Just(0u64), 6 => 0..=window / 4, 1 => 0..=window * 2];
    let op = prop_oneof![
        6 => (dt.clone(), 0..=limit + 2).prop_map(|(dt, cost)| Op::Decide { dt, cost }),
        3 => (dt.clone(), any::<usize>(), 0..=limit + 2)
            .prop_map(|(dt, which, amount)| Op::Refund { dt, which, amount }),
        1 => (dt, any::<usize>(), 1..=limit + 2)
            .prop_map(|(dt, which, amount)| Op::Extra { dt, which, amount }),
    ];
    proptest::collection::vec(op, 1..120)
}

fn case() -> impl Strategy<Value = (u64, u64, Vec<Op>)> {
    (1u64..=30, 1u64..=60)
        .prop_flat_map(|(limit, window)| (Just(limit), Just(window), ops(window, limit)))
}

/// Net cost in `(t - W, t]` of the charges `(time, net)`.
fn net_in(charges: &[(u64, u64)], w: u64, t: u64) -> u64 {
    charges
        .iter()
        .filter(|c| c.0 + w > t && c.0 <= t)
        .map(|c| c.1)
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Admissions, refunds of earlier charges and extra charges in any
    /// order: the net cost (charged - refunded, extra charges at their
    /// time) in every `(t - W, t]` stays at or below L; decisions and
    /// waits are exact against the charges.
    #[test]
    fn net_cost_in_every_window_is_within_the_limit((limit, w, ops) in case()) {
        let alg = log(limit, w);
        let mut s = SlidingLogState::default();
        let mut now = 1_000u64;
        // (time, net) of every charge; holds index into it.
        let mut charges: Vec<(u64, u64)> = Vec::new();
        let mut holds: Vec<(Hold, usize)> = Vec::new();
        for op in ops {
            match op {
                Op::Decide { dt, cost } => {
                    now += dt;
                    let held = net_in(&charges, w, now);
                    let d = alg.check(&mut s, now, cost);
                    prop_assert_eq!(d.admitted, cost <= limit && held + cost <= limit);
                    if !d.admitted && cost <= limit {
                        // The wait: the first time the charges still held
                        // then leave room.
                        let wait = (1..=w)
                            .find(|&d| net_in(&charges, w, now + d) + cost <= limit)
                            .unwrap();
                        prop_assert_eq!(d.retry_after, Some(micros(wait)));
                    }
                    if d.admitted {
                        let h = alg.record(&mut s, now, cost);
                        prop_assert_eq!(h.amount, cost);
                        if cost > 0 {
                            charges.push((now, cost));
                            holds.push((h, charges.len() - 1));
                        }
                    }
                }
                Op::Refund { dt, which, amount } => {
                    now += dt;
                    if holds.is_empty() { continue; }
                    let (h, c) = holds[which % holds.len()];
                    let i = which % holds.len();
                    let expected = if charges[c].0 + w > now {
                        amount.min(h.amount).min(charges[c].1)
                    } else {
                        0
                    };
                    let after = alg.settle(&mut s, now, h, -i64::try_from(amount).unwrap());
                    prop_assert_eq!(h.amount - after.amount, expected);
                    prop_assert_eq!(after.mark, h.mark);
                    charges[c].1 -= expected;
                    holds[i].0 = after;
                }
                Op::Extra { dt, which, amount } => {
                    now += dt;
                    let h = holds
                        .get(which % holds.len().max(1))
                        .map_or(Hold::default(), |h| h.0);
                    let add = amount.min(limit.saturating_sub(net_in(&charges, w, now)));
                    let delta = i64::try_from(amount).unwrap();
                    prop_assert_eq!(alg.settle(&mut s, now, h, delta), h);
                    if add > 0 {
                        charges.push((now, add));
                    }
                }
            }
            let held = net_in(&charges, w, now);
            prop_assert!(held <= limit);
            prop_assert_eq!(alg.check(&mut s.clone(), now, 0).remaining, limit - held);
        }
        for &(t, _) in &charges {
            prop_assert!(net_in(&charges, w, t) <= limit, "window ending at {}", t);
        }
    }

    /// Random limit and window changes (both directions), clock steps
    /// both ways, refunds and extra charges: never a panic, never a
    /// wait longer than the new window, and every answer equal to the
    /// naive log's.
    #[test]
    fn changed_policies_never_panic_and_waits_fit_the_window(
        start in prop_oneof![Just(0u64), 0u64..=1 << 52, Just(u64::MAX - 500)],
        first in (1u64..=40, 1u64..=100),
        steps in proptest::collection::vec(
            (
                prop_oneof![
                    24 => Just(None),
                    6 => (1u64..=40, 1u64..=100).prop_map(Some),
                    1 => Just(Some((SlidingLog::MAX_LIMIT, u64::MAX))),
                    1 => (1u64..=3, prop_oneof![Just(u64::MAX), Just(1u64 << 62)])
                        .prop_map(Some),
                    1 => (Just(SlidingLog::MAX_LIMIT), 1u64..=100).prop_map(Some),
                ],
                prop_oneof![8 => -10i64..=20, 1 => -200i64..=200],
                prop_oneof![5 => 0u64..=45, 1 => Just(u64::MAX), 1 => Just(1u64 << 62)],
                0u8..4,
                any::<usize>(),
            ),
            1..150,
        ),
    ) {
        let mut s = SlidingLogState::default();
        let mut naive = Naive::default();
        let mut holds: Vec<Hold> = Vec::new();
        let mut now = start;
        let (mut limit, mut window) = first;
        for (i, (change, dt, cost, kind, which)) in steps.into_iter().enumerate() {
            if let Some((l, w)) = change {
                (limit, window) = (l, w);
            }
            let alg = log(limit, window);
            now = now.saturating_add_signed(dt);
            match kind {
                0 | 1 => {
                    let d = alg.check(&mut s, now, cost);
                    let expected = naive.check(&alg, now, cost);
                    prop_assert_eq!(&d, &expected, "op {}", i);
                    if let Some(wait) = d.retry_after {
                        prop_assert!(wait >= micros(1) && wait <= micros(window), "op {}", i);
                    }
                    if d.admitted {
                        let h = alg.record(&mut s, now, cost);
                        prop_assert_eq!(h, naive.record(&alg, now, cost), "op {}", i);
                        holds.push(h);
                    }
                }
                2 => {
                    let h = holds.get(which % holds.len().max(1)).copied().unwrap_or_default();
                    let delta = -i64::try_from(cost.min(1 << 62)).unwrap();
                    let got = alg.settle(&mut s, now, h, delta);
                    prop_assert_eq!(got, naive.settle(&alg, now, h, delta), "op {}", i);
                    let at = which % holds.len().max(1);
                    if let Some(slot) = holds.get_mut(at) {
                        *slot = got;
                    }
                }
                _ => {
                    let h = Hold::default();
                    let delta = i64::try_from(cost.min(1 << 62)).unwrap();
                    let got = alg.settle(&mut s, now, h, delta);
                    prop_assert_eq!(got, naive.settle(&alg, now, h, delta), "op {}", i);
                }
            }
            prop_assert_eq!(s.total(), naive.held(), "op {}", i);
            prop_assert_eq!(s.len(), naive.entries.len(), "op {}", i);
        }
    }
}
