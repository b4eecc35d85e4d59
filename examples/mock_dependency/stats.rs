//! What `GET /stats` and `GET /stats/series` report, and the bounded
//! histogram the latency percentiles come from.

use std::time::Duration;

use serde::Serialize;

/// The latencies the histogram tells apart: 1 ms buckets for `0..10 s`. The
/// longer ones share one overflow bucket, so memory is the same however long
/// the mock runs (80 KB).
pub(crate) const HISTOGRAM_MS: u64 = 10_000;

/// What `GET /stats` reports. Every field counts since start or the last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Stats {
    /// Arrivals: every request to a path other than the control paths,
    /// refused ones included.
    pub(crate) total: u64,
    /// The most arrivals, refused ones included, in any window `(t - 1 s, t]`.
    pub(crate) max_in_any_1s: u64,
    /// The most arrivals in flight (arrived, not yet answered) at once.
    pub(crate) max_concurrent: u64,
    /// Arrivals answered 429 because the window was over the limit.
    pub(crate) rejected: u64,
    /// Accepted arrivals answered 503 by `fail_every`.
    pub(crate) failed: u64,
    /// The median latency of the answered arrivals (every status), in whole
    /// milliseconds rounded down; `None` (`null`) before the first answer.
    pub(crate) p50_ms: Option<u64>,
    /// The 99th percentile latency, as `p50_ms`.
    pub(crate) p99_ms: Option<u64>,
}

/// What `GET /stats/series` reports: arrivals per whole second since start or
/// the last reset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Series {
    /// The second `arrivals[0]` counts, in whole seconds since start or the
    /// last reset: 0 until more than [`SERIES_SECONDS`](super::SERIES_SECONDS)
    /// have passed.
    pub(crate) first_second: u64,
    /// `arrivals[i]`: the arrivals, refused ones included, in the second
    /// `[first_second + i, first_second + i + 1)`. The last entry is the
    /// second in progress.
    pub(crate) arrivals: Vec<u64>,
}

/// Answered latencies in 1 ms buckets up to [`HISTOGRAM_MS`], plus one
/// overflow bucket and the largest latency seen.
#[derive(Debug, Clone)]
pub(crate) struct Latencies {
    /// `buckets[k]` counts the latencies in `[k ms, k + 1 ms)`; the last one
    /// counts those from [`HISTOGRAM_MS`] up.
    buckets: Box<[u64]>,
    count: u64,
    max_ms: u64,
}

impl Default for Latencies {
    fn default() -> Self {
        Latencies {
            buckets: vec![0; HISTOGRAM_MS as usize + 1].into_boxed_slice(),
            count: 0,
            max_ms: 0,
        }
    }
}

impl Latencies {
    /// Records one answered latency.
    pub(crate) fn record(&mut self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.buckets[ms.min(HISTOGRAM_MS) as usize] += 1;
        self.count += 1;
        self.max_ms = self.max_ms.max(ms);
    }

    /// How many buckets the histogram has: always `HISTOGRAM_MS + 1`.
    pub(crate) fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// How many latencies were recorded.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    /// The `p`-th percentile (`0 < p <= 100`) by nearest rank: the smallest
    /// recorded latency, in whole ms, that at least `ceil(p% × count)` of
    /// them are at or under. In the overflow bucket it is the largest
    /// latency seen. `None` when nothing was recorded.
    pub(crate) fn percentile(&self, p: u64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = (u128::from(self.count) * u128::from(p.clamp(1, 100))).div_ceil(100);
        let mut seen = 0u128;
        for (ms, &n) in self.buckets.iter().enumerate() {
            seen += u128::from(n);
            if seen >= rank {
                let ms = ms as u64;
                return Some(if ms == HISTOGRAM_MS { self.max_ms } else { ms });
            }
        }
        Some(self.max_ms)
    }
}
