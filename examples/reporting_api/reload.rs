//! Reloading `--config` while the API runs: on SIGHUP, and when the file
//! changes.
//!
//! The file is watched by what its path resolves to, read every 500 ms:
//! device, inode, modification time and length. A rewrite in place, an
//! atomic rename over it and a swapped symlink (the way a Kubernetes
//! ConfigMap is updated: `..data` pointing at a new directory) each change
//! that, without relying on file-system events.
//!
//! A reload reads and checks the whole file, then checks every layer's new
//! numbers, and only then applies them:
//!
//! | applied live | kept as started (restart to change) |
//! |---|---|
//! | `default_plan`, `plans.*`, `aggregate`: the quotas | `server.listen`, `server.redis`: the listen address, the store |
//! | `concurrency.*`: caps, queues, deadlines | `keys`, `server.header_read_timeout`, `shutdown.limit` |
//! | `body.*`: the wire and decoded caps | `query.*`, `batch.*`: the handlers read them too |
//! | | `plans.*.class`, `dependency.concurrency`: the outbound adaptive limit |
//! | `dependency.normal_per_second`, `dependency.retry_per_second`: the budget (on Redis, the lease's `R`, sent with its next refresh) | the rest of `dependency.*` |
//!
//! A bad file keeps the running configuration: the log names the file, the
//! line, the key path and the reason, and `/metrics` shows the failure. A
//! setting that cannot change while running is named in the log when the
//! file differs from what runs.
//!
//! | metric | labels | what |
//! |---|---|---|
//! | `reporting_api_config_generation` | | configurations applied since start (0: the one started with) |
//! | `reporting_api_config_last_reload_success` | | 1 when the last reload applied, 0 when it failed |
//! | `reporting_api_config_reloads_total` | `result` | reloads, `success` or `failure` |

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use tower_admission::bounds::BodyCaps;
use tower_admission::concurrency::ConcurrencyLayerBuilder;
use tower_admission::outbound::BudgetShares;
#[cfg(feature = "redis")]
use tower_admission::outbound::Rate;
use tower_admission::quota::Quotas;
use tower_admission::reload::ReloadHandle;
use tower_admission::ConfigError;

use crate::app::LayerQuotas;
use crate::config::Config;

/// How often the watcher looks at the file.
const POLL: Duration = Duration::from_millis(500);

/// The reload handles of every layer whose numbers the file sets.
pub(crate) struct Handles {
    pub(crate) per_user: ReloadHandle<Quotas>,
    pub(crate) aggregate: ReloadHandle<Quotas>,
    pub(crate) rows: ReloadHandle<Quotas>,
    pub(crate) items: ReloadHandle<Quotas>,
    pub(crate) concurrency: ReloadHandle<ConcurrencyLayerBuilder>,
    pub(crate) body: ReloadHandle<BodyCaps>,
    /// The dependency budget; set by `main.rs`, which builds it.
    pub(crate) budget: Option<Budget>,
}

/// The dependency budget's reload handle.
pub(crate) enum Budget {
    /// One instance's, in memory.
    Memory(ReloadHandle<BudgetShares>),
    /// The fleet's lease on Redis: its normal and retry rates (`R` is their sum).
    #[cfg(feature = "redis")]
    Leased(ReloadHandle<BudgetShares<Rate>>),
}

/// Every layer's new numbers, built from a config.
struct Next {
    quotas: LayerQuotas,
    concurrency: ConcurrencyLayerBuilder,
    budget: BudgetShares,
    #[cfg(feature = "redis")]
    rates: BudgetShares<Rate>,
}

impl Handles {
    /// Checks every layer's numbers of `config`, then applies them all:
    /// one bad value applies nothing.
    fn apply(&self, config: &Config) -> Result<(), ConfigError> {
        let next = Next {
            quotas: LayerQuotas::of(config)?,
            concurrency: config.concurrency_builder(),
            budget: BudgetShares::new(
                crate::config::Dependency::share_policy(
                    "normal",
                    config.dependency.normal_per_second,
                )?,
                crate::config::Dependency::share_policy(
                    "retry",
                    config.dependency.retry_per_second,
                )?,
            ),
            #[cfg(feature = "redis")]
            rates: BudgetShares::new(
                Rate::per_second(config.dependency.normal_per_second),
                Rate::per_second(config.dependency.retry_per_second),
            ),
        };
        let at = |key: &'static str| move |e: ConfigError| ConfigError::new(key, e.to_string());
        self.per_user
            .check(&next.quotas.per_user)
            .map_err(at("plans"))?;
        self.aggregate
            .check(&next.quotas.aggregate)
            .map_err(at("aggregate"))?;
        self.rows.check(&next.quotas.work).map_err(at("plans"))?;
        self.items.check(&next.quotas.work).map_err(at("plans"))?;
        self.concurrency
            .check(&next.concurrency)
            .map_err(at("concurrency"))?;
        match &self.budget {
            Some(Budget::Memory(budget)) => budget.check(&next.budget),
            #[cfg(feature = "redis")]
            Some(Budget::Leased(lease)) => lease.check(&next.rates),
            None => Ok(()),
        }
        .map_err(at("dependency"))?;
        // Checked: each apply below checks again and cannot fail.
        self.per_user.apply(next.quotas.per_user)?;
        self.aggregate.apply(next.quotas.aggregate)?;
        self.rows.apply(next.quotas.work.clone())?;
        self.items.apply(next.quotas.work)?;
        self.concurrency.apply(next.concurrency)?;
        self.body.apply(BodyCaps {
            wire_bytes: config.body.max_wire_bytes,
            decoded_bytes: config.body.max_decoded_bytes,
        })?;
        match &self.budget {
            Some(Budget::Memory(budget)) => budget.apply(next.budget)?,
            #[cfg(feature = "redis")]
            Some(Budget::Leased(lease)) => lease.apply(next.rates)?,
            None => {}
        }
        Ok(())
    }
}

/// What the process runs with that no reload changes.
#[derive(Debug, Clone)]
pub(crate) struct Fixed {
    pub(crate) listen: SocketAddr,
    pub(crate) redis: Option<String>,
    /// The file as started, for the settings it holds that cannot change.
    pub(crate) started: Config,
}

/// Reloads the file at `path` into `handles`.
pub(crate) struct Reloader {
    path: PathBuf,
    handles: Handles,
    fixed: Fixed,
    /// The file's identity when it was last read; held while a reload runs,
    /// so SIGHUP and the watcher never reload at once.
    seen: Mutex<Option<FileId>>,
    generation: Mutex<u64>,
}

/// What tells one version of the file from another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    modified: Option<SystemTime>,
    len: u64,
}

/// The identity of the file `path` resolves to (symlinks followed).
fn file_id(path: &Path) -> Option<FileId> {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    let (dev, ino) = {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    };
    #[cfg(not(unix))]
    let (dev, ino) = (0, 0);
    Some(FileId {
        dev,
        ino,
        modified: meta.modified().ok(),
        len: meta.len(),
    })
}

impl Reloader {
    /// A reloader of `path`, whose configuration as started is in `fixed`.
    pub(crate) fn new(path: PathBuf, handles: Handles, fixed: Fixed) -> Arc<Self> {
        metrics::gauge!("reporting_api_config_generation").set(0.0);
        metrics::gauge!("reporting_api_config_last_reload_success").set(1.0);
        for result in ["success", "failure"] {
            metrics::counter!("reporting_api_config_reloads_total", "result" => result).absolute(0);
        }
        Arc::new(Reloader {
            seen: Mutex::new(file_id(&path)),
            path,
            handles,
            fixed,
            generation: Mutex::new(0),
        })
    }

    /// Reloads on SIGHUP and whenever the file changes, for the life of the
    /// process.
    pub(crate) fn spawn(self: &Arc<Self>) {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            match signal(SignalKind::hangup()) {
                Ok(mut hangup) => {
                    let this = Arc::clone(self);
                    tokio::spawn(async move {
                        while hangup.recv().await.is_some() {
                            let this = Arc::clone(&this);
                            let _ =
                                tokio::task::spawn_blocking(move || this.reload("SIGHUP")).await;
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(%e, "cannot listen for SIGHUP; the file watcher still reloads")
                }
            }
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(POLL);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                let changed = file_id(&this.path) != *this.seen.lock();
                if changed {
                    let this = Arc::clone(&this);
                    let _ = tokio::task::spawn_blocking(move || this.reload("file changed")).await;
                }
            }
        });
    }

    /// Reads, checks and applies the file; a bad one changes nothing.
    pub(crate) fn reload(&self, cause: &str) {
        let mut seen = self.seen.lock();
        let id = file_id(&self.path);
        if cause != "SIGHUP" && id == *seen {
            return;
        }
        *seen = id;
        let file = self.path.display().to_string();
        let result = Config::load(&self.path).and_then(|config| {
            self.name_fixed(&config);
            self.handles
                .apply(&config)
                .map_err(|e| format!("{file}: {}: {}", e.field(), e.reason()))
        });
        match result {
            Ok(()) => {
                let mut generation = self.generation.lock();
                *generation += 1;
                metrics::gauge!("reporting_api_config_generation").set(*generation as f64);
                metrics::gauge!("reporting_api_config_last_reload_success").set(1.0);
                metrics::counter!("reporting_api_config_reloads_total", "result" => "success")
                    .increment(1);
                tracing::info!(%file, cause, generation = *generation, "configuration reloaded");
            }
            Err(message) => {
                metrics::gauge!("reporting_api_config_last_reload_success").set(0.0);
                metrics::counter!("reporting_api_config_reloads_total", "result" => "failure")
                    .increment(1);
                tracing::error!(
                    %file,
                    cause,
                    "configuration reload failed, the running configuration is kept: {message}"
                );
            }
        }
    }

    /// Logs each setting of `config` that differs from what runs and cannot
    /// change while running, by its key path.
    fn name_fixed(&self, config: &Config) {
        let fixed = &self.fixed;
        let started = &fixed.started;
        let mut kept: Vec<&str> = Vec::new();
        if config.server.listen.is_some_and(|a| a != fixed.listen) {
            kept.push("server.listen");
        }
        if config.server.redis.is_some() && config.server.redis != fixed.redis {
            kept.push("server.redis");
        }
        let classes = |c: &Config| -> Vec<(String, String)> {
            c.plans
                .iter()
                .map(|(plan, p)| (plan.clone(), format!("{:?}", p.class)))
                .collect()
        };
        let checks: [(&str, bool); 8] = [
            ("plans.*.class", classes(config) != classes(started)),
            (
                "dependency.concurrency",
                config.dependency.concurrency != started.dependency.concurrency,
            ),
            ("keys", config.keys != started.keys),
            (
                "server.header_read_timeout",
                config.server.header_read_timeout != started.server.header_read_timeout,
            ),
            ("shutdown.limit", config.shutdown != started.shutdown),
            ("query", config.query != started.query),
            ("batch", config.batch != started.batch),
            (
                "dependency",
                (
                    config.dependency.attempts,
                    config.dependency.budget_wait,
                    config.dependency.timeout,
                ) != (
                    started.dependency.attempts,
                    started.dependency.budget_wait,
                    started.dependency.timeout,
                ),
            ),
        ];
        kept.extend(
            checks
                .iter()
                .filter(|(_, differs)| *differs)
                .map(|(key, _)| *key),
        );
        for key in kept {
            tracing::warn!(
                key,
                "this setting cannot change while running; it is kept as started (restart to change it)"
            );
        }
    }
}
