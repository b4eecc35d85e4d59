//! Criticality classes and the share of the limit each may fill.

use std::fmt;

use crate::ConfigError;

/// How much a request matters when the limit is short, from least to most.
///
/// A class comes from authenticated context, through a function of the
/// request that the operator configures (the plan of the
/// [`Identity`](crate::identity::Identity), the route), never from a header
/// the client chose unless the operator configures that.
///
/// ```
/// use tower_admission::concurrency::Criticality;
///
/// assert!(Criticality::Sheddable < Criticality::Critical);
/// assert_eq!(Criticality::default(), Criticality::Default);
/// assert_eq!(Criticality::Sheddable.as_str(), "sheddable");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Criticality {
    /// Refused first: it may fill only its share of the limit.
    Sheddable,
    /// Ordinary work: it may fill its share of the limit, leaving the rest
    /// to critical work.
    #[default]
    Default,
    /// May fill the whole limit, and is served first from the queue.
    Critical,
}

impl Criticality {
    /// Every class, from most to least critical: the order waiters are
    /// served in.
    pub const BY_PRIORITY: [Criticality; 3] = [
        Criticality::Critical,
        Criticality::Default,
        Criticality::Sheddable,
    ];

    /// Lower-case name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Criticality::Sheddable => "sheddable",
            Criticality::Default => "default",
            Criticality::Critical => "critical",
        }
    }

    /// Index in per-class arrays: sheddable 0, default 1, critical 2.
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Criticality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Default share of the limit sheddable work may fill.
pub(crate) const DEFAULT_SHEDDABLE_SHARE: f64 = 0.8;
/// Default share of the limit default work may fill.
pub(crate) const DEFAULT_DEFAULT_SHARE: f64 = 0.9;

/// The share of the limit each class may fill, sheddable then default;
/// critical fills it all. A class is admitted only while the requests in
/// flight *of every class* are below its share of the limit (at least 1),
/// so `1 - default` of the limit is kept for critical work and `1 -
/// sheddable` from sheddable work.
pub(crate) fn checked_shares(sheddable: f64, default: f64) -> Result<[f64; 3], ConfigError> {
    if !(sheddable > 0.0 && sheddable <= default) {
        return Err(ConfigError::new(
            "class_shares.sheddable",
            "must be above 0 and at most the default share",
        ));
    }
    if default.is_nan() || default > 1.0 {
        return Err(ConfigError::new(
            "class_shares.default",
            "must be at most 1",
        ));
    }
    Ok([sheddable, default, 1.0])
}

/// The most requests in flight of every class under which `class` is
/// admitted, for `limit`.
pub(crate) fn class_cap(shares: &[f64; 3], class: Criticality, limit: usize) -> usize {
    match class {
        Criticality::Critical => limit,
        _ => ((shares[class.index()] * limit as f64) as usize).max(1),
    }
}
