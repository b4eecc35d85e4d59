//! The adaptive limit's parameters, their defaults and their checks.

use std::time::Duration;

use crate::ConfigError;

/// The parameters of an adaptive concurrency limit; see the
/// [module docs](crate::concurrency#the-algorithm) for the algorithm.
///
/// Every setter keeps the other defaults. The values are checked when a
/// builder takes them ([`ConcurrencyLayerBuilder::global_adaptive`],
/// [`AdaptiveLimitLayer::builder`]), which fails with a
/// [`ConfigError`] naming the field (`adaptive.floor`, …).
///
/// [`ConcurrencyLayerBuilder::global_adaptive`]: crate::concurrency::ConcurrencyLayerBuilder::global_adaptive
/// [`AdaptiveLimitLayer::builder`]: crate::concurrency::AdaptiveLimitLayer::builder
///
/// ```
/// use std::time::Duration;
/// use tower_admission::concurrency::AdaptiveLimit;
///
/// let limit = AdaptiveLimit::default()
///     .bounds(4, 400)
///     .initial(40)
///     .probe(Duration::from_secs(30), 2, 25);
/// assert_eq!(limit.floor(), 4);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdaptiveLimit {
    pub(crate) initial: usize,
    pub(crate) floor: usize,
    pub(crate) ceiling: usize,
    pub(crate) window: Duration,
    pub(crate) min_samples: usize,
    pub(crate) percentile: f64,
    pub(crate) tolerance: f64,
    pub(crate) smoothing: f64,
    pub(crate) backoff: f64,
    pub(crate) utilisation: f64,
    pub(crate) probe_interval: Duration,
    pub(crate) probe_limit: usize,
    pub(crate) probe_samples: usize,
}

impl Default for AdaptiveLimit {
    /// Initial 20, floor 1, ceiling 1000; windows of 100 ms and at least 10
    /// samples, measured at their 90th percentile; tolerance 25 %,
    /// smoothing 0.5, back-off 0.9, growth only past 80 % use; a baseline
    /// probe every 60 s at 3 in flight for 25 samples.
    fn default() -> Self {
        AdaptiveLimit {
            initial: 20,
            floor: 1,
            ceiling: 1000,
            window: Duration::from_millis(100),
            min_samples: 10,
            percentile: 0.9,
            tolerance: 0.25,
            smoothing: 0.5,
            backoff: 0.9,
            utilisation: 0.8,
            probe_interval: Duration::from_secs(60),
            probe_limit: 3,
            probe_samples: 25,
        }
    }
}

impl AdaptiveLimit {
    /// The limit before the first measurement (default 20).
    pub fn initial(mut self, limit: usize) -> Self {
        self.initial = limit;
        self
    }

    /// The limit never goes below `floor` nor above `ceiling` (defaults 1
    /// and 1000), except while probing the baseline (see
    /// [`probe`](Self::probe)).
    pub fn bounds(mut self, floor: usize, ceiling: usize) -> Self {
        self.floor = floor;
        self.ceiling = ceiling;
        self
    }

    /// The sample window: the limit moves once per `window` (default
    /// 100 ms) that holds at least `min_samples` samples (default 10); a
    /// window with fewer is extended, so an idle service keeps its limit.
    pub fn window(mut self, window: Duration, min_samples: usize) -> Self {
        self.window = window;
        self.min_samples = min_samples;
        self
    }

    /// Which percentile of a window's latencies is its latency (default
    /// 0.9), and of the probe's the baseline.
    pub fn percentile(mut self, percentile: f64) -> Self {
        self.percentile = percentile;
        self
    }

    /// The latency the limit aims at, as a share above the baseline
    /// (default 0.25: 125 % of the baseline).
    pub fn tolerance(mut self, tolerance: f64) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The share of the way to its target the limit moves per window
    /// (default 0.5; 1 jumps straight to it).
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.smoothing = smoothing;
        self
    }

    /// The factor the limit is multiplied by after a window with an
    /// overload outcome (an error or a timeout; default 0.9).
    pub fn backoff(mut self, backoff: f64) -> Self {
        self.backoff = backoff;
        self
    }

    /// The limit grows only after a window whose most requests in flight
    /// reached this share of it (default 0.8): no growth without evidence
    /// that the limit was used.
    pub fn utilisation(mut self, share: f64) -> Self {
        self.utilisation = share;
        self
    }

    /// The baseline probe: every `interval` (default 60 s, counted from the
    /// end of the previous probe, and first at start), the limit drops to
    /// `limit` in flight (default 3; its own level, not the floor) until
    /// `samples` requests admitted during the probe have answered (default
    /// 25); the baseline is their latency, and the limit goes back where it
    /// was.
    pub fn probe(mut self, interval: Duration, limit: usize, samples: usize) -> Self {
        self.probe_interval = interval;
        self.probe_limit = limit;
        self.probe_samples = samples;
        self
    }

    /// The floor.
    pub fn floor(&self) -> usize {
        self.floor
    }

    /// The ceiling.
    pub fn ceiling(&self) -> usize {
        self.ceiling
    }

    /// Checks every parameter; the error names the field.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let share = |v: f64| v > 0.0 && v <= 1.0;
        let checks: [(bool, &'static str, &'static str); 13] = [
            (self.floor >= 1, "adaptive.floor", "must be at least 1"),
            (
                self.ceiling >= self.floor,
                "adaptive.ceiling",
                "must be at least the floor",
            ),
            (
                (self.floor..=self.ceiling).contains(&self.initial),
                "adaptive.initial",
                "must be between the floor and the ceiling",
            ),
            (
                !self.window.is_zero() && self.window <= ONE_DAY,
                "adaptive.window",
                "must be above zero and at most one day",
            ),
            (
                self.min_samples >= 1,
                "adaptive.min_samples",
                "must be at least 1",
            ),
            (
                share(self.percentile),
                "adaptive.percentile",
                "must be in (0, 1]",
            ),
            (
                (0.0..=10.0).contains(&self.tolerance),
                "adaptive.tolerance",
                "must be in [0, 10]",
            ),
            (
                share(self.smoothing),
                "adaptive.smoothing",
                "must be in (0, 1]",
            ),
            (
                self.backoff > 0.0 && self.backoff < 1.0,
                "adaptive.backoff",
                "must be in (0, 1)",
            ),
            (
                share(self.utilisation),
                "adaptive.utilisation",
                "must be in (0, 1]",
            ),
            (
                !self.probe_interval.is_zero() && self.probe_interval <= ONE_DAY,
                "adaptive.probe_interval",
                "must be above zero and at most one day",
            ),
            (
                (1..=self.ceiling).contains(&self.probe_limit),
                "adaptive.probe_limit",
                "must be between 1 and the ceiling",
            ),
            (
                self.probe_samples >= 1,
                "adaptive.probe_samples",
                "must be at least 1",
            ),
        ];
        for (ok, field, reason) in checks {
            if !ok {
                return Err(ConfigError::new(field, reason));
            }
        }
        Ok(())
    }
}

const ONE_DAY: Duration = Duration::from_secs(24 * 3600);
