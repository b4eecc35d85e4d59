//! Every knob of the reporting API, read from a TOML file.
//!
//! The built-in defaults are `reporting.toml` beside this file, compiled in;
//! `--config PATH` reads another. A bad file is refused with the file, the
//! line, the key path and the reason, for example
//! `reporting.toml:38: plans.free.policies[1].refill: must be at least 1`.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use serde::Deserialize;
use tower_admission::concurrency::{ConcurrencyLayer, ConcurrencyLayerBuilder};
use tower_admission::identity::{ApiKeys, Identity};
use tower_admission::jobs::{JobQueue, JobQueueBuilder};
use tower_admission::quota::{Policy, Quota};
use tower_admission::ConfigError;

use super::overload;

/// The shipped file, which is also the built-in default.
pub(crate) const BUILTIN: &str = include_str!("reporting.toml");

/// The whole configuration, as the file spells it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    /// The plan of identities whose plan has no entry of its own.
    pub(crate) default_plan: String,
    pub(crate) keys: Vec<DemoKey>,
    pub(crate) plans: BTreeMap<String, Plan>,
    pub(crate) aggregate: Policies,
    pub(crate) body: Body,
    pub(crate) query: Query,
    pub(crate) batch: Batch,
    pub(crate) concurrency: Concurrency,
    pub(crate) dependency: Dependency,
    /// The server's own limits; a file without this table gets 10 s.
    #[serde(default)]
    pub(crate) server: Server,
    /// What a shutdown waits for; a file without this table gets 60 s.
    #[serde(default)]
    pub(crate) shutdown: Shutdown,
}

/// A connection that has not sent a whole request head within
/// `header_read_timeout` (of its start, or of its previous response) is
/// closed. `listen` and `redis` stand for `--listen` and `--redis` when the
/// command line does not give them; neither changes while running.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Server {
    pub(crate) header_read_timeout: Span,
    #[serde(default)]
    pub(crate) listen: Option<std::net::SocketAddr>,
    #[serde(default)]
    pub(crate) redis: Option<String>,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            header_read_timeout: Span(Duration::from_secs(10)),
            listen: None,
            redis: None,
        }
    }
}

/// After SIGINT or SIGTERM: requests in flight finish and accepted jobs
/// drain, all within `limit` of the signal; past it the process exits 1.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Shutdown {
    pub(crate) limit: Span,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            limit: Span(Duration::from_secs(60)),
        }
    }
}

/// One API key and the identity it authenticates.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DemoKey {
    pub(crate) key: String,
    pub(crate) subject: String,
    pub(crate) tenant: String,
    pub(crate) plan: String,
}

/// A plan: requests per user, and work (rows read, batch items) per user.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Plan {
    pub(crate) policies: Vec<PolicySpec>,
    pub(crate) work: Vec<PolicySpec>,
    /// Its callers' dependency calls under overload; `default` when absent.
    #[serde(default)]
    pub(crate) class: overload::Class,
}

/// A list of policies.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Policies {
    pub(crate) policies: Vec<PolicySpec>,
}

/// One policy, named by its algorithm. Read through [`RawPolicy`], so that a
/// bad value is named by its own key (`policies[0].limit`), not only by its
/// policy's.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawPolicy")]
pub(crate) enum PolicySpec {
    FixedWindow {
        name: String,
        limit: u64,
        window: Span,
    },
    SlidingLog {
        name: String,
        limit: u64,
        window: Span,
    },
    SlidingWindow {
        name: String,
        limit: u64,
        window: Span,
    },
    TokenBucket {
        name: String,
        capacity: u64,
        refill: u64,
        period: Span,
    },
}

/// A policy as the file spells it: every key any algorithm takes, each
/// checked against the algorithm named.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    name: String,
    algorithm: AlgorithmName,
    limit: Option<u64>,
    window: Option<Span>,
    capacity: Option<u64>,
    refill: Option<u64>,
    period: Option<Span>,
}

/// The algorithms a policy can name.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
enum AlgorithmName {
    FixedWindow,
    SlidingLog,
    SlidingWindow,
    TokenBucket,
}

impl TryFrom<RawPolicy> for PolicySpec {
    type Error = String;

    fn try_from(raw: RawPolicy) -> Result<Self, String> {
        let (algorithm, takes): (&str, &[&str]) = match raw.algorithm {
            AlgorithmName::FixedWindow => ("fixed_window", &["limit", "window"]),
            AlgorithmName::SlidingLog => ("sliding_log", &["limit", "window"]),
            AlgorithmName::SlidingWindow => ("sliding_window", &["limit", "window"]),
            AlgorithmName::TokenBucket => ("token_bucket", &["capacity", "refill", "period"]),
        };
        let given = [
            ("limit", raw.limit.is_some()),
            ("window", raw.window.is_some()),
            ("capacity", raw.capacity.is_some()),
            ("refill", raw.refill.is_some()),
            ("period", raw.period.is_some()),
        ];
        let expected = || {
            let keys: Vec<String> = takes.iter().map(|k| format!("`{k}`")).collect();
            format!("a {algorithm} policy takes `name`, {}", keys.join(", "))
        };
        for (key, present) in given {
            if present && !takes.contains(&key) {
                return Err(format!("unknown field `{key}`: {}", expected()));
            }
            if !present && takes.contains(&key) {
                return Err(format!("missing field `{key}`: {}", expected()));
            }
        }
        let (name, limit, window) = (raw.name, raw.limit.unwrap_or(0), raw.window);
        let window = window.unwrap_or(Span(Duration::ZERO));
        Ok(match raw.algorithm {
            AlgorithmName::FixedWindow => PolicySpec::FixedWindow {
                name,
                limit,
                window,
            },
            AlgorithmName::SlidingLog => PolicySpec::SlidingLog {
                name,
                limit,
                window,
            },
            AlgorithmName::SlidingWindow => PolicySpec::SlidingWindow {
                name,
                limit,
                window,
            },
            AlgorithmName::TokenBucket => PolicySpec::TokenBucket {
                name,
                capacity: raw.capacity.unwrap_or(0),
                refill: raw.refill.unwrap_or(0),
                period: raw.period.unwrap_or(Span(Duration::ZERO)),
            },
        })
    }
}

/// Body caps, in bytes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Body {
    pub(crate) max_wire_bytes: usize,
    pub(crate) max_decoded_bytes: usize,
}

/// Page and range limits of `GET /v1/reports`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Query {
    pub(crate) default_page_size: u32,
    pub(crate) max_page_size: u32,
    pub(crate) max_span: Span,
}

/// Batch limits of `POST /v1/reports/batch`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Batch {
    /// Batches up to this many items are answered at once.
    pub(crate) sync_items: usize,
    /// Batches up to this many items are accepted as jobs; more get 413.
    pub(crate) max_items: usize,
    /// Items calling the dependency at once, per request.
    pub(crate) active_items: usize,
    /// Jobs queued at most.
    pub(crate) job_queue: usize,
    /// Jobs run at once.
    pub(crate) job_workers: usize,
    /// Jobs one user may have waiting or running.
    pub(crate) jobs_per_user: usize,
    /// How long a finished job can be read.
    pub(crate) job_retention: Span,
}

/// Concurrency caps.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Concurrency {
    pub(crate) global: Cap,
    pub(crate) per_identity: Cap,
}

/// In flight at most `limit`, `queue` more waiting up to `deadline`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Cap {
    pub(crate) limit: usize,
    pub(crate) queue: usize,
    pub(crate) deadline: Span,
}

/// The dependency budget and client.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Dependency {
    /// First attempts per second, fleet-wide.
    pub(crate) normal_per_second: u64,
    /// Retries per second, fleet-wide.
    pub(crate) retry_per_second: u64,
    /// Attempts per call, the first included.
    pub(crate) attempts: u32,
    /// The longest an attempt waits for the budget.
    pub(crate) budget_wait: Span,
    /// The longest one attempt waits for an answer.
    pub(crate) timeout: Span,
    /// The limit on calls in flight; adaptive when the table is absent.
    #[serde(default)]
    pub(crate) concurrency: overload::Settings,
}

impl Dependency {
    /// The token bucket of one share of the in-memory budget: `per_second`
    /// refilled every second, with a burst of 25 ms of it (at least 1).
    pub(crate) fn share_policy(share: &str, per_second: u64) -> Result<Policy, ConfigError> {
        Policy::token_bucket(
            share,
            (per_second / 40).max(1),
            per_second,
            Duration::from_secs(1),
        )
    }
}

/// A duration written with a unit: `250ms`, `2s`, `60s`, `5m`, `1h`, `31d`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span(pub(crate) Duration);

impl<'de> Deserialize<'de> for Span {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_span(&text)
            .map(Span)
            .map_err(serde::de::Error::custom)
    }
}

fn parse_span(text: &str) -> Result<Duration, String> {
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as \"250ms\", \"60s\" or \"31d\""))?;
    if unit.starts_with(['.', ',']) {
        return Err(format!(
            "{text:?}: use a whole number with its unit, e.g. \"1500ms\" for 1.5 s"
        ));
    }
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{text:?}: the unit must be ms, s, m, h or d")),
    };
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too long"))
}

/// A bad configuration: where and why. `path` is the key path, or
/// `(file)` for the file as a whole (a TOML syntax error, a missing
/// top-level table); `line` is the line of the file it is on, from 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BadConfig {
    pub(crate) path: String,
    pub(crate) line: Option<usize>,
    pub(crate) reason: String,
}

/// The key path of the file as a whole.
const WHOLE_FILE: &str = "(file)";

impl BadConfig {
    /// The message for `file`: `FILE:LINE: PATH: REASON`, the line left out
    /// when the problem is on none (a missing top-level key), the path left
    /// out for a syntax error.
    pub(crate) fn in_file(&self, file: &str) -> String {
        match (self.line, self.path == WHOLE_FILE) {
            (Some(line), true) => format!("{file}:{line}: {}", self.reason),
            (Some(line), false) => format!("{file}:{line}: {self}"),
            (None, _) => format!("{file}: {self}"),
        }
    }
}

impl std::fmt::Display for BadConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.reason)
    }
}

fn bad(path: impl Into<String>, reason: impl Into<String>) -> BadConfig {
    BadConfig {
        path: path.into(),
        line: None,
        reason: reason.into(),
    }
}

/// The line (from 1) of byte `offset` of `text`.
fn line_at(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// The line of the deepest key of `path` (`plans.free.policies[1].refill`)
/// that `text` has: the key's own line, or its table's or array item's
/// when the key is missing there. `None` for the whole file.
fn line_of_path(text: &str, path: &str) -> Option<usize> {
    if path == WHOLE_FILE {
        return None;
    }
    let root = toml::de::DeTable::parse(text).ok()?.into_inner();
    let mut value = toml::de::DeValue::Table(root);
    let mut span = None;
    for segment in path.split('.') {
        let (key, indices) = segment.split_once('[').unwrap_or((segment, ""));
        let mut found = match value.get(key) {
            Some(found) => found.clone(),
            None => break,
        };
        let mut complete = true;
        for index in indices.split('[').filter(|i| !i.is_empty()) {
            let item = index
                .trim_end_matches(']')
                .parse::<usize>()
                .ok()
                .and_then(|i| found.get_ref().get(i).cloned());
            match item {
                Some(item) => found = item,
                None => {
                    complete = false;
                    break;
                }
            }
        }
        span = Some(found.span());
        if !complete {
            break;
        }
        value = found.into_inner();
    }
    span.map(|span| line_at(text, span.start))
}

/// The quotas a config builds, checked.
#[derive(Debug, Clone)]
pub(crate) struct Quotas {
    /// Requests per user, by plan; the default plan's is `requests_default`.
    pub(crate) requests: BTreeMap<String, Quota>,
    /// Work per user, by plan.
    pub(crate) work: BTreeMap<String, Quota>,
    pub(crate) aggregate: Quota,
}

impl Config {
    /// The built-in configuration (`reporting.toml`).
    pub(crate) fn builtin() -> Config {
        // The shipped file is checked by a test; a broken one cannot ship.
        Config::parse(BUILTIN).unwrap_or_else(|e| panic!("reporting.toml: {e}"))
    }

    /// Reads and checks the file at `path`.
    pub(crate) fn load(path: &std::path::Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        Config::parse(&text).map_err(|e| e.in_file(&path.display().to_string()))
    }

    /// Parses and checks a whole file; a refusal says the line it is on.
    pub(crate) fn parse(text: &str) -> Result<Config, BadConfig> {
        Config::parse_and_check(text).map_err(|mut e| {
            if e.line.is_none() {
                e.line = line_of_path(text, &e.path);
            }
            e
        })
    }

    fn parse_and_check(text: &str) -> Result<Config, BadConfig> {
        let spanned = |e: toml::de::Error, path: String| BadConfig {
            line: e.span().map(|span| line_at(text, span.start)),
            reason: e.message().to_owned(),
            path,
        };
        let de = toml::Deserializer::parse(text).map_err(|e| spanned(e, WHOLE_FILE.into()))?;
        let config: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            if path == "." {
                // A missing top-level key is on no line.
                return bad(WHOLE_FILE, e.into_inner().message());
            }
            // The key's own line; a value the file does not hold (one
            // built from several keys) is placed by the parser's span.
            let line = line_of_path(text, &path);
            let mut e = spanned(e.into_inner(), path);
            e.line = line.or(e.line);
            e
        })?;
        config.check()?;
        Ok(config)
    }

    /// Every rule the types cannot say; each names its key path.
    fn check(&self) -> Result<(), BadConfig> {
        if !self.plans.contains_key(&self.default_plan) {
            return Err(bad(
                "default_plan",
                format!("no plan named {:?}", self.default_plan),
            ));
        }
        for (i, key) in self.keys.iter().enumerate() {
            self.check_key(i, key)?;
        }
        self.quotas()?;
        let at_least_one = |path: &str, n: u64| {
            if n == 0 {
                Err(bad(path, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        at_least_one("body.max_wire_bytes", self.body.max_wire_bytes as u64)?;
        at_least_one("body.max_decoded_bytes", self.body.max_decoded_bytes as u64)?;
        let above_zero = |path: &str, span: Span| {
            if span.0.is_zero() {
                Err(bad(path, "must be above zero"))
            } else {
                Ok(())
            }
        };
        at_least_one(
            "query.default_page_size",
            u64::from(self.query.default_page_size),
        )?;
        if self.query.max_page_size < self.query.default_page_size {
            return Err(bad(
                "query.max_page_size",
                "must be at least query.default_page_size",
            ));
        }
        above_zero("query.max_span", self.query.max_span)?;
        at_least_one("batch.sync_items", self.batch.sync_items as u64)?;
        if self.batch.max_items < self.batch.sync_items {
            return Err(bad("batch.max_items", "must be at least batch.sync_items"));
        }
        at_least_one("batch.active_items", self.batch.active_items as u64)?;
        self.job_queue().check().map_err(|e| {
            let key = match e.field() {
                "capacity" => "job_queue",
                "workers" => "job_workers",
                "per_owner" => "jobs_per_user",
                "finished_ttl" => "job_retention",
                other => other,
            };
            bad(format!("batch.{key}"), e.reason())
        })?;
        at_least_one(
            "dependency.normal_per_second",
            self.dependency.normal_per_second,
        )?;
        at_least_one(
            "dependency.retry_per_second",
            self.dependency.retry_per_second,
        )?;
        // Each rate must make a token bucket, as the in-memory budget builds.
        let rates = [
            ("normal", self.dependency.normal_per_second),
            ("retry", self.dependency.retry_per_second),
        ];
        for (share, per_second) in rates {
            Dependency::share_policy(share, per_second)
                .map_err(|e| bad(format!("dependency.{share}_per_second"), e.reason()))?;
        }
        at_least_one("dependency.attempts", u64::from(self.dependency.attempts))?;
        self.dependency
            .concurrency
            .limit()
            .map_err(|e| bad(format!("dependency.concurrency.{}", e.field()), e.reason()))?;
        above_zero("dependency.timeout", self.dependency.timeout)?;
        above_zero(
            "server.header_read_timeout",
            self.server.header_read_timeout,
        )?;
        above_zero("shutdown.limit", self.shutdown.limit)?;
        self.concurrency_layer()
            .map_err(|e| bad(format!("concurrency.{}", e.field()), e.reason()))?;
        Ok(())
    }

    /// The rules of `keys[i]`: a key the `Authorization` header can carry,
    /// given once; a subject that names one user (one tenant, one plan), as
    /// every quota, cap and job owner is keyed by subject.
    fn check_key(&self, i: usize, key: &DemoKey) -> Result<(), BadConfig> {
        ApiKeys::check_key(key.key.as_bytes())
            .map_err(|e| bad(format!("keys[{i}].key"), e.reason()))?;
        if key.subject.is_empty() {
            return Err(bad(format!("keys[{i}].subject"), "must not be empty"));
        }
        if !self.plans.contains_key(&key.plan) {
            return Err(bad(
                format!("keys[{i}].plan"),
                format!("no plan named {:?}", key.plan),
            ));
        }
        for (j, earlier) in self.keys[..i].iter().enumerate() {
            if earlier.key == key.key {
                return Err(bad(
                    format!("keys[{i}].key"),
                    format!("the same key as keys[{j}]"),
                ));
            }
            let same_user = (&earlier.tenant, &earlier.plan) == (&key.tenant, &key.plan);
            if earlier.subject == key.subject && !same_user {
                return Err(bad(
                    format!("keys[{i}].subject"),
                    format!(
                        "{:?} is keys[{j}]'s subject with another tenant or plan",
                        key.subject
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every quota, built and checked.
    pub(crate) fn quotas(&self) -> Result<Quotas, BadConfig> {
        let mut requests = BTreeMap::new();
        let mut work = BTreeMap::new();
        for (plan, spec) in &self.plans {
            let at = format!("plans.{plan}");
            requests.insert(
                plan.clone(),
                quota(
                    &format!("requests-{plan}"),
                    &spec.policies,
                    &format!("{at}.policies"),
                )?,
            );
            work.insert(
                plan.clone(),
                quota(&format!("work-{plan}"), &spec.work, &format!("{at}.work"))?,
            );
        }
        let aggregate = quota(
            "all-callers",
            &self.aggregate.policies,
            "aggregate.policies",
        )?;
        Ok(Quotas {
            requests,
            work,
            aggregate,
        })
    }

    /// The demo keys as an authenticator's key table.
    pub(crate) fn api_keys(&self) -> ApiKeys {
        self.keys.iter().fold(ApiKeys::new(), |keys, k| {
            keys.with_key(&k.key, Identity::new(&*k.subject, &*k.tenant, &*k.plan))
        })
    }

    /// The batch job queue's bounds. Until a job has finished, a job is
    /// assumed to take what the dependency budget allows the largest one:
    /// `max_items` x 2 first attempts at `normal_per_second` (10 s as
    /// shipped), in its refusals' `Retry-After`.
    pub(crate) fn job_queue(&self) -> JobQueueBuilder {
        let calls = u64::try_from(self.batch.max_items)
            .unwrap_or(u64::MAX)
            .saturating_mul(2);
        let assumed = Duration::from_millis(
            calls.saturating_mul(1_000) / self.dependency.normal_per_second.max(1),
        );
        JobQueue::builder()
            .retry_after(assumed)
            .capacity(self.batch.job_queue)
            .workers(self.batch.job_workers)
            .per_owner(self.batch.jobs_per_user)
            .finished_ttl(self.batch.job_retention.0)
    }

    /// The concurrency caps.
    pub(crate) fn concurrency_layer(&self) -> Result<ConcurrencyLayer, ConfigError> {
        self.concurrency_builder().build()
    }

    /// The concurrency caps, as a reload applies them.
    pub(crate) fn concurrency_builder(&self) -> ConcurrencyLayerBuilder {
        let (g, p) = (&self.concurrency.global, &self.concurrency.per_identity);
        ConcurrencyLayer::builder()
            .global(g.limit, g.queue, g.deadline.0)
            .per_identity(p.limit, p.queue, p.deadline.0)
    }

    /// The page sizes, checked to be at least 1.
    pub(crate) fn page_sizes(&self) -> (NonZeroU32, NonZeroU32) {
        let nonzero = |n| NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        (
            nonzero(self.query.default_page_size),
            nonzero(self.query.max_page_size),
        )
    }
}

/// A quota named `name` of `specs`, whose key path is `at`.
fn quota(name: &str, specs: &[PolicySpec], at: &str) -> Result<Quota, BadConfig> {
    let policies = specs
        .iter()
        .enumerate()
        .map(|(i, spec)| {
            spec.policy()
                .map_err(|e| bad(format!("{at}[{i}].{}", e.field()), e.reason()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Quota::new(name, policies).map_err(|e| bad(at, e.reason()))
}

impl PolicySpec {
    fn policy(&self) -> Result<Policy, ConfigError> {
        match self {
            PolicySpec::FixedWindow {
                name,
                limit,
                window,
            } => Policy::fixed_window(name, *limit, window.0),
            PolicySpec::SlidingLog {
                name,
                limit,
                window,
            } => Policy::sliding_log(name, *limit, window.0),
            PolicySpec::SlidingWindow {
                name,
                limit,
                window,
            } => Policy::sliding_window(name, *limit, window.0),
            PolicySpec::TokenBucket {
                name,
                capacity,
                refill,
                period,
            } => Policy::token_bucket(name, *capacity, *refill, period.0),
        }
    }
}
