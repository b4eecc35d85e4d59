use super::*;

const MS: Duration = Duration::from_millis(1);

fn cfg() -> AdaptiveLimit {
    AdaptiveLimit::default()
        .initial(100)
        .bounds(10, 400)
        .window(Duration::from_millis(100), 10)
        .probe(Duration::from_secs(60), 3, 5)
}

/// A controller past its first probe, whose requests answered in 20 ms:
/// baseline 20 ms, limit 100, at `t0 + 1 s`.
fn measured() -> (Controller, Instant) {
    let t0 = Instant::now();
    let mut c = Controller::new(cfg(), t0);
    assert!(c.probing());
    assert_eq!(c.limit(), 3);
    let now = t0 + Duration::from_secs(1);
    for i in 0..5 {
        let moved = c.sample(now, 1, 20 * MS, Sample::Answered(Outcome::Success), 0);
        assert_eq!(moved, i == 4);
    }
    assert!(!c.probing());
    assert_eq!(c.baseline(), Some(20 * MS));
    assert_eq!(c.limit(), 100);
    (c, now)
}

/// One window of `n` samples of `latency` read as `sample`, with `in_flight`
/// requests in flight at its peak; returns the time after it.
fn window(
    c: &mut Controller,
    start: Instant,
    n: usize,
    latency: Duration,
    sample: Sample,
    in_flight: usize,
) -> Instant {
    c.admitted(in_flight);
    let end = start + Duration::from_millis(100);
    for i in 0..n {
        let at = if i + 1 == n { end } else { start + MS };
        c.sample(at, c.epoch(), latency, sample, in_flight);
    }
    end
}

#[test]
fn latency_at_the_goal_grows_only_a_used_limit() {
    let (mut c, mut now) = measured();
    // Latency at the baseline, 50 of 100 in flight: no evidence, no growth.
    for _ in 0..100 {
        now = window(
            &mut c,
            now,
            20,
            20 * MS,
            Sample::Answered(Outcome::Success),
            50,
        );
    }
    assert_eq!(c.limit(), 100);
    // Used (90 of 100): goal 25 / latency 20 = 1.25, so the target is
    // 100 × 1.25 + 10 = 135 and the limit moves half-way, to 117.5.
    window(
        &mut c,
        now,
        20,
        20 * MS,
        Sample::Answered(Outcome::Success),
        90,
    );
    assert_eq!(c.limit(), 117);
    assert_eq!(c.latency(), Some(20 * MS));
}

#[test]
fn latency_over_the_goal_lowers_the_limit_to_the_floor_at_most() {
    let (mut c, mut now) = measured();
    // 50 ms against a goal of 25 ms: gradient 0.5, target 50 (no headroom
    // over the goal), limit 100 + 0.5 × (50 - 100) = 75.
    now = window(
        &mut c,
        now,
        20,
        50 * MS,
        Sample::Answered(Outcome::Success),
        100,
    );
    assert_eq!(c.limit(), 75);
    for _ in 0..50 {
        now = window(
            &mut c,
            now,
            20,
            500 * MS,
            Sample::Answered(Outcome::Success),
            100,
        );
    }
    assert_eq!(c.limit(), 10);
}

#[test]
fn an_overload_backs_off_once_per_window() {
    let (mut c, now) = measured();
    c.sample(
        now + MS,
        c.epoch(),
        5 * MS,
        Sample::Answered(Outcome::Overload),
        100,
    );
    c.sample(
        now + 2 * MS,
        c.epoch(),
        5 * MS,
        Sample::Answered(Outcome::Overload),
        100,
    );
    assert_eq!(c.limit(), 100);
    c.sample(
        now + 100 * MS,
        c.epoch(),
        5 * MS,
        Sample::Answered(Outcome::Overload),
        100,
    );
    assert_eq!(c.limit(), 90);
}

#[test]
fn an_idle_or_quiet_window_keeps_the_limit() {
    let (mut c, now) = measured();
    // Nine samples over ten seconds: fewer than ten, the window goes on.
    for i in 1..10 {
        let moved = c.sample(
            now + Duration::from_secs(i),
            c.epoch(),
            200 * MS,
            Sample::Answered(Outcome::Success),
            100,
        );
        assert!(!moved);
    }
    assert_eq!(c.limit(), 100);
    assert_eq!(c.latency(), None);
}

/// Callers that give up after 1 ms while the limit is full: a reading of a
/// dropped request as an answer at the moment it was dropped sees 1 ms
/// against a 20 ms baseline and raises the limit; these give no sample.
#[test]
fn requests_dropped_early_are_no_fast_successes() {
    let (mut c, mut now) = measured();
    for _ in 0..20 {
        now = window(&mut c, now, 20, MS, Sample::Dropped, 100);
    }
    assert_eq!(c.limit(), 100);
    assert_eq!(c.latency(), None);
    assert_eq!(c.baseline(), Some(20 * MS));

    // The naive reading of the same drops, for contrast: the limit climbs.
    let (mut naive, mut now) = measured();
    for _ in 0..20 {
        now = window(
            &mut naive,
            now,
            20,
            MS,
            Sample::Answered(Outcome::Success),
            400,
        );
    }
    assert_eq!(naive.limit(), 400);
}

#[test]
fn requests_dropped_after_the_goal_count_as_slow() {
    let (mut c, now) = measured();
    // Dropped after 100 ms (over the 25 ms goal): gradient 0.25 → 0.5,
    // target 50, limit 75, as for answers that slow.
    window(&mut c, now, 20, 100 * MS, Sample::Dropped, 100);
    assert_eq!(c.limit(), 75);
    assert_eq!(c.latency(), Some(100 * MS));
}

#[test]
fn the_probe_measures_only_requests_admitted_during_it() {
    let (mut c, mut now) = measured();
    let before = c.epoch();
    // A window ends past the probe interval: the probe starts.
    now += Duration::from_secs(60);
    now = window(
        &mut c,
        now,
        10,
        20 * MS,
        Sample::Answered(Outcome::Success),
        50,
    );
    assert!(c.probing());
    assert_eq!(c.limit(), 3);
    // Requests admitted before the probe answer slowly: not the baseline.
    for _ in 0..10 {
        c.sample(now, before, 80 * MS, Sample::Answered(Outcome::Success), 40);
    }
    assert!(c.probing());
    // Five admitted during the probe, at 30 ms: the new baseline.
    for _ in 0..5 {
        c.sample(
            now,
            c.epoch(),
            30 * MS,
            Sample::Answered(Outcome::Success),
            2,
        );
    }
    assert!(!c.probing());
    assert_eq!(c.baseline(), Some(30 * MS));
    assert_eq!(c.limit(), 100);
}

#[test]
fn the_probe_level_is_not_the_floor() {
    let t0 = Instant::now();
    let c = Controller::new(cfg(), t0);
    assert_eq!((c.limit(), cfg().floor()), (3, 10));
}

/// A class held to its share of the limit never fills the limit itself:
/// its requests finding no slot are the evidence instead.
#[test]
fn requests_finding_no_slot_are_evidence_of_use() {
    let (mut c, now) = measured();
    // 50 of 100 in flight (a sheddable share of 0.5, say), latency at the
    // baseline: no growth; then a request that found no slot, and the limit
    // grows as in `latency_at_the_goal_grows_only_a_used_limit`.
    let now = window(
        &mut c,
        now,
        20,
        20 * MS,
        Sample::Answered(Outcome::Success),
        50,
    );
    assert_eq!(c.limit(), 100);
    c.pressed();
    window(
        &mut c,
        now,
        20,
        20 * MS,
        Sample::Answered(Outcome::Success),
        50,
    );
    assert_eq!(c.limit(), 117);
}

/// The limits in force over 300 windows against a dependency that serves 2
/// at a time in 20 ms and shares itself above that (latency 20 ms × in
/// flight / 2), always offered more than the limit, after a baseline of
/// 20 ms and from a limit of 20.
fn at_capacity_two(tolerance: f64) -> Vec<usize> {
    let cfg = AdaptiveLimit::default()
        .initial(20)
        .bounds(1, 1000)
        .tolerance(tolerance)
        .probe(Duration::from_secs(600), 2, 5);
    let mut now = Instant::now();
    let mut c = Controller::new(cfg, now);
    for _ in 0..5 {
        c.sample(now, 1, 20 * MS, Sample::Answered(Outcome::Success), 0);
    }
    assert_eq!((c.baseline(), c.limit()), (Some(20 * MS), 20));
    let mut in_force = Vec::new();
    for _ in 0..300 {
        let n = c.limit();
        let latency = 20 * MS * (n.max(2) as u32) / 2;
        c.pressed();
        now = window(
            &mut c,
            now,
            10,
            latency,
            Sample::Answered(Outcome::Success),
            n,
        );
        in_force.push(n);
    }
    in_force
}

/// At the default tolerance (goal 25 ms) the limit may step once past the
/// goal (3 in flight, 30 ms), never to 4 (40 ms, twice the base): the
/// growth is measured from the limit that was in force, not from its
/// fraction that admitted no one.
#[test]
fn growth_at_a_small_capacity_steps_once_past_the_goal() {
    let in_force = at_capacity_two(0.25);
    let settled = &in_force[50..];
    assert_eq!(
        (settled.iter().min(), settled.iter().max()),
        (Some(&2), Some(&3)),
        "{in_force:?}"
    );
}

/// At a tolerance of 0.5 (goal 30 ms) 3 in flight answer in 30 ms, within
/// the goal, and the limit stays there. Growing past it on √limit of
/// headroom would put 4 in flight at 40 ms, twice the base; the headroom
/// applies only in the lower half of the band.
#[test]
fn a_limit_whose_latency_is_at_the_goal_stays_there() {
    let in_force = at_capacity_two(0.5);
    let settled = &in_force[50..];
    assert_eq!(
        (settled.iter().min(), settled.iter().max()),
        (Some(&3), Some(&3)),
        "{in_force:?}"
    );
}
