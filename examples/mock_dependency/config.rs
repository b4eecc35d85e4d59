//! The mock's settings: their defaults and ranges, written once for the
//! command line and for `GET /config` and `POST /config`.

use std::num::{NonZeroU32, NonZeroU64};
use std::ops::RangeInclusive;
use std::time::Duration;

use serde_json::{Map, Value};

/// The longest `latency_ms`: one hour.
pub(crate) const MAX_LATENCY_MS: u64 = 3_600_000;

/// How the mock behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MockConfig {
    /// The most arrivals allowed in any 1 s window; the one over it gets 429.
    pub(crate) limit: NonZeroU32,
    /// The work every arrival brings: how long it takes when the mock is
    /// within its capacity.
    pub(crate) latency: Duration,
    /// How many arrivals are served at full speed at once; above it they
    /// share it (see `capacity.rs`). `None` is unlimited.
    pub(crate) capacity: Option<NonZeroU32>,
    /// Every K-th accepted arrival answers 503; `None` never fails.
    pub(crate) fail_every: Option<NonZeroU64>,
}

impl Default for MockConfig {
    /// Limit 300 per second, 5 ms latency, unlimited capacity, no injected
    /// failures.
    fn default() -> Self {
        Self {
            limit: NonZeroU32::new(300).expect("300 is not zero"),
            latency: Duration::from_millis(5),
            capacity: None,
            fail_every: None,
        }
    }
}

/// One setting, by its JSON name (`limit`) and its flag (`--limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Field {
    /// `limit`: arrivals per second.
    Limit,
    /// `latency_ms`: the work of one arrival.
    LatencyMs,
    /// `capacity`: 0 is unlimited.
    Capacity,
    /// `fail_every`: 0 never fails.
    FailEvery,
}

impl Field {
    /// Every setting.
    pub(crate) const ALL: [Field; 4] = [
        Field::Limit,
        Field::LatencyMs,
        Field::Capacity,
        Field::FailEvery,
    ];

    /// The JSON name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Field::Limit => "limit",
            Field::LatencyMs => "latency_ms",
            Field::Capacity => "capacity",
            Field::FailEvery => "fail_every",
        }
    }

    /// The command-line flag.
    pub(crate) fn flag(self) -> &'static str {
        match self {
            Field::Limit => "--limit",
            Field::LatencyMs => "--latency-ms",
            Field::Capacity => "--capacity",
            Field::FailEvery => "--fail-every",
        }
    }

    /// The setting whose JSON name is `name`.
    pub(crate) fn named(name: &str) -> Option<Field> {
        Field::ALL.into_iter().find(|f| f.name() == name)
    }

    fn range(self) -> RangeInclusive<u64> {
        match self {
            Field::Limit => 1..=u64::from(u32::MAX),
            Field::LatencyMs => 0..=MAX_LATENCY_MS,
            Field::Capacity => 0..=u64::from(u32::MAX),
            Field::FailEvery => 0..=u64::MAX,
        }
    }

    /// What a value must be, e.g. "a whole number of arrivals per second
    /// from 1 to 4294967295".
    pub(crate) fn expected(self) -> String {
        let (what, note) = match self {
            Field::Limit => ("a whole number of arrivals per second", ""),
            Field::LatencyMs => ("a whole number of milliseconds", ""),
            Field::Capacity => ("a whole number of requests", " (0 = unlimited)"),
            Field::FailEvery => (
                "a whole number",
                " (0 = never fail, K = every K-th accepted arrival)",
            ),
        };
        let range = self.range();
        format!("{what} from {} to {}{note}", range.start(), range.end())
    }

    /// The setting's value in `config`, as `GET /config` shows it.
    pub(crate) fn get(self, config: &MockConfig) -> u64 {
        match self {
            Field::Limit => u64::from(config.limit.get()),
            Field::LatencyMs => u64::try_from(config.latency.as_millis()).unwrap_or(u64::MAX),
            Field::Capacity => config.capacity.map_or(0, |c| u64::from(c.get())),
            Field::FailEvery => config.fail_every.map_or(0, NonZeroU64::get),
        }
    }

    /// Sets the setting in `config` to `value`, or says why it cannot.
    pub(crate) fn set(self, config: &mut MockConfig, value: u64) -> Result<(), String> {
        if !self.range().contains(&value) {
            return Err(format!("{value} is not {}", self.expected()));
        }
        // In range, so the conversions hold.
        let small = u32::try_from(value).unwrap_or(u32::MAX);
        match self {
            Field::Limit => config.limit = NonZeroU32::new(small).unwrap_or(NonZeroU32::MIN),
            Field::LatencyMs => config.latency = Duration::from_millis(value),
            Field::Capacity => config.capacity = NonZeroU32::new(small),
            Field::FailEvery => config.fail_every = NonZeroU64::new(value),
        }
        Ok(())
    }
}

/// Every setting of `config` as one JSON object: the body of `GET /config`.
pub(crate) fn to_json(config: &MockConfig) -> Value {
    let fields = Field::ALL
        .into_iter()
        .map(|f| (f.name().to_owned(), Value::from(f.get(config))));
    Value::Object(fields.collect())
}

/// A refused field of a `POST /config` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FieldError {
    /// The field's name as it was sent.
    pub(crate) name: String,
    /// Why it is refused.
    pub(crate) reason: String,
}

/// Why a `POST /config` body is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PatchError {
    /// The body is not a JSON object.
    NotAnObject(String),
    /// Some fields are unknown or out of range: each one of them.
    Fields(Vec<FieldError>),
}

/// Applies a `POST /config` body to `config`: all of it, or nothing when any
/// field is refused. Returns the new settings.
pub(crate) fn patch(config: &MockConfig, body: &[u8]) -> Result<MockConfig, PatchError> {
    let object: Map<String, Value> = match serde_json::from_slice(body) {
        Ok(Value::Object(object)) => object,
        Ok(other) => {
            return Err(PatchError::NotAnObject(format!(
                "the body is {other}, not a JSON object of settings"
            )))
        }
        Err(e) => {
            return Err(PatchError::NotAnObject(format!(
                "the body is not JSON ({e})"
            )))
        }
    };
    let mut next = *config;
    let mut errors = Vec::new();
    for (name, value) in &object {
        let Some(field) = Field::named(name) else {
            let known: Vec<_> = Field::ALL.iter().map(|f| f.name()).collect();
            errors.push(FieldError {
                name: name.clone(),
                reason: format!("unknown setting; known are {}", known.join(", ")),
            });
            continue;
        };
        let set = match value.as_u64() {
            Some(v) => field.set(&mut next, v),
            None => Err(format!("{value} is not {}", field.expected())),
        };
        if let Err(reason) = set {
            errors.push(FieldError {
                name: name.clone(),
                reason,
            });
        }
    }
    if errors.is_empty() {
        Ok(next)
    } else {
        Err(PatchError::Fields(errors))
    }
}

impl PatchError {
    /// The `detail` of the problem document.
    pub(crate) fn detail(&self) -> String {
        match self {
            PatchError::NotAnObject(detail) => detail.clone(),
            PatchError::Fields(errors) => errors
                .iter()
                .map(|e| format!("{}: {}", e.name, e.reason))
                .collect::<Vec<_>>()
                .join("; "),
        }
    }

    /// The 400 `application/problem+json` document (RFC 9457), with an
    /// `errors` member naming each refused field.
    pub(crate) fn problem(&self) -> Value {
        let mut doc = serde_json::json!({
            "type": "about:blank",
            "title": "Bad Request",
            "status": 400,
            "detail": self.detail(),
        });
        if let PatchError::Fields(errors) = self {
            doc["errors"] = errors
                .iter()
                .map(|e| serde_json::json!({"name": e.name, "reason": e.reason}))
                .collect();
        }
        doc
    }
}
