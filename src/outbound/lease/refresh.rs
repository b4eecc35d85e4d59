//! Refreshing a lease: one grant call, its reply taken in, the background
//! refresher, and the release.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::task::JoinHandle;

use super::state::Phase;
use super::store::{Args, GrantReply};
use super::{LeaseError, LeaseStatus, Rate, RateLease, Shared};
use crate::clock::{duration_to_micros, Clock, Timestamp};

impl<C: Clock> RateLease<C> {
    /// Refreshes the grant now with the measured demand, whatever the
    /// schedule. One refresh runs at a time per lease (a second call waits).
    ///
    /// The local send instant is read before anything is sent; the old grant
    /// stays in use until the reply arrives, and the new one lasts
    /// `expiry − now_in_reply` from that send instant. On failure the
    /// current grant is kept until it expires, then the fallback applies,
    /// and the next refresh is due after `retry_every`. A refresh dropped
    /// before its reply (an outer timeout, an aborted refresher) has failed:
    /// a grant the script may have issued for it is never spent.
    pub async fn refresh(&self) -> Result<LeaseStatus, LeaseError> {
        let inner = &*self.inner;
        let cfg = &inner.settings();
        let _one = inner.refreshing.lock().await;
        let (sent_at, args) = {
            let mut s = inner.state.lock();
            if s.phase == Phase::Released {
                return Err(LeaseError::Released);
            }
            let x = Timestamp::now(&inner.clock);
            s.advance(x, cfg);
            let asked_unmeasured = s.unmeasured;
            let (demand, flag) = s.take_demand(x, cfg);
            // A grant asked for without a measure (a guess, a doubling)
            // that the first measure finds too large gives its surplus
            // back now rather than at its expiry, keeping a quarter above
            // the measure (a short window can miss part of a burst).
            let keep = Rate(demand.0.saturating_add(demand.0 / 4));
            let lowered = if asked_unmeasured && !s.unmeasured && s.lower_to(keep, x, cfg) {
                keep
            } else {
                Rate::ZERO
            };
            s.calls += 1;
            let held = if s.phase == Phase::Active && x < s.until {
                (s.grant, s.until.0 - x.0)
            } else {
                (Rate::ZERO, 0)
            };
            let kept = if s.phase == Phase::Active && x < s.kept_until {
                (s.kept, s.kept_until.0 - x.0)
            } else {
                (Rate::ZERO, 0)
            };
            let args = Args {
                op: "g",
                life: self.inner.life,
                demand,
                flag,
                budget: inner
                    .ceiling
                    .as_ref()
                    .map_or(cfg.rate, |c| c.get().min(cfg.rate)),
                lease_us: cfg.lease_us,
                held,
                kept,
                pushed: std::mem::take(&mut s.pushed),
                lowered,
                number: s.calls,
            };
            (x, args)
        };
        let unfinished = UnfinishedRefresh {
            lease: self,
            sent_at,
        };
        let result = inner.store.grant(&inner.key, &inner.id, &args).await;
        std::mem::forget(unfinished);
        if result.is_err() && args.pushed {
            // Reported with the next refresh instead.
            inner.state.lock().pushed = true;
        }
        self.finish(sent_at, result)
    }

    /// Takes in the outcome of a refresh sent at `sent_at`, answered now; the
    /// lease is ready from then on.
    pub(super) fn finish(
        &self,
        sent_at: Timestamp,
        result: Result<GrantReply, LeaseError>,
    ) -> Result<LeaseStatus, LeaseError> {
        let outcome = self.apply(sent_at, Timestamp::now(&self.inner.clock), result);
        self.inner.ready.send_replace(true);
        outcome
    }

    /// Takes in the outcome of a refresh sent at `sent_at`, answered at `recv`.
    pub(super) fn apply(
        &self,
        sent_at: Timestamp,
        recv: Timestamp,
        result: Result<GrantReply, LeaseError>,
    ) -> Result<LeaseStatus, LeaseError> {
        let inner = &*self.inner;
        let cfg = &inner.settings();
        let mut s = inner.state.lock();
        if s.phase == Phase::Released {
            return Err(LeaseError::Released);
        }
        s.advance(recv, cfg);
        let before = s.shape();
        let outcome = match result {
            Ok(reply) => {
                let life = reply.expiry.saturating_sub(reply.now);
                let older = [(s.grant, s.until), (s.kept, s.kept_until)];
                s.phase = Phase::Active;
                s.grant = reply.rate;
                s.until = Timestamp(sent_at.0.saturating_add(life).saturating_sub(cfg.margin_us));
                // A lowered grant: the script counts the older, higher one
                // until its expiry, so it is spent until then (the highest
                // one still running), unless pushback lowered the budget,
                // when the fleet must spend less at once.
                (s.kept, s.kept_until) = (Rate::ZERO, Timestamp(0));
                if reply.effective >= cfg.rate {
                    for (rate, until) in older {
                        if rate > s.grant && rate > s.kept && until > recv {
                            (s.kept, s.kept_until) = (rate, until.min(s.until));
                        }
                    }
                }
                s.target = reply.target;
                s.note_effective(reply.effective, &inner.budget);
                s.failures = 0;
                s.id_taken = false;
                let cap = cfg.capacity(s.rate_at(recv, cfg));
                s.bucket.cap(cap);
                // A guess, or an ask carried over a zero grant, is followed
                // a quarter period later by a measure; while pushback lowers
                // the budget, every refresh is, so that grants follow it
                // within about a second.
                let period = if s.guessing || s.carried || s.effective < cfg.rate {
                    cfg.refresh_us / 4
                } else {
                    cfg.refresh_us
                };
                let mut next = sent_at.0.saturating_add(period);
                if reply.recheck > reply.now {
                    next = next.min(recv.0.saturating_add(reply.recheck - reply.now));
                }
                s.next_refresh = Timestamp(next);
                if s.fallback && recv < s.until {
                    s.fallback = false;
                    tracing::info!(
                        budget = &*inner.budget,
                        instance = &*inner.id,
                        grant = %s.grant,
                        "rate lease renewed; the fallback capacity no longer applies"
                    );
                }
                s.note_fallback(recv, cfg, &inner.budget, &inner.id);
                Ok(s.status(recv, cfg))
            }
            Err(LeaseError::InstanceIdInUse { ref id, free_in }) => {
                // The script counts another lease's grants under this id,
                // not this one's: whatever this lease holds stops now, and
                // it spends the fallback capacity, as when Redis is
                // unreachable (never without limit, even when failing
                // open: Redis is reachable and said no). It tries again
                // when the other's grants expire.
                if s.phase == Phase::Starting {
                    s.phase = Phase::Active;
                    s.last = recv;
                }
                s.until = Timestamp(s.until.0.min(recv.0));
                (s.kept, s.kept_until) = (Rate::ZERO, Timestamp(0));
                s.bucket.cap(cfg.capacity(cfg.fallback));
                s.failures = s.failures.saturating_add(1);
                s.id_in_use = s.id_in_use.saturating_add(1);
                let wait = duration_to_micros(free_in).max(1);
                s.next_refresh = Timestamp(recv.0.saturating_add(wait));
                #[cfg(feature = "metrics")]
                metrics::counter!(
                    "tower_admission_lease_id_in_use_total",
                    "budget" => inner.budget.to_string()
                )
                .increment(1);
                if !s.id_taken {
                    s.id_taken = true;
                    // Logged here, not as an expiry.
                    s.fallback = true;
                    tracing::error!(
                        budget = &*inner.budget,
                        instance = &**id,
                        fallback = %cfg.fallback,
                        free_in = ?free_in,
                        "rate lease refused: instance id {id:?} is held by another live lease (is it configured in two processes?); spending the fallback capacity until the id is free"
                    );
                }
                Err(LeaseError::InstanceIdInUse {
                    id: id.clone(),
                    free_in,
                })
            }
            Err(error) => {
                if s.phase == Phase::Starting {
                    s.phase = Phase::Active;
                    s.until = Timestamp(0);
                    s.last = recv;
                }
                s.failures = s.failures.saturating_add(1);
                s.next_refresh = Timestamp(recv.0.saturating_add(cfg.retry_us));
                tracing::debug!(
                    budget = &*inner.budget,
                    instance = &*inner.id,
                    %error,
                    failures = s.failures,
                    "rate lease refresh failed; keeping the current grant until it expires"
                );
                s.note_fallback(recv, cfg, &inner.budget, &inner.id);
                Err(error)
            }
        };
        s.note_change(before, recv);
        outcome
    }

    /// Waits until the first refresh has finished, successful or not (one
    /// dropped before its reply has failed), or the lease was released: it has
    /// stopped [starting](super::LeaseStatus::is_starting) (for a
    /// readiness check).
    pub async fn ready(&self) {
        let mut ready = self.inner.ready.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = ready.wait_for(|r| *r).await;
    }

    /// The time from the local now to the next refresh.
    pub fn until_next_refresh(&self) -> Duration {
        let now = Timestamp::now(&self.inner.clock);
        self.inner.state.lock().next_refresh.since(now)
    }

    /// Spawns the background refresher on the current tokio runtime: it
    /// refreshes at once, a quarter period later with the first measured
    /// demand (likewise after the fallback), then every `refresh_every`
    /// (earlier when the script says a larger share frees up; every
    /// `retry_every` after a failure). It sleeps on tokio's timer and holds
    /// the lease weakly: it ends when every clone of the lease is dropped,
    /// or at once when the lease is released. Abort the handle to stop it
    /// sooner.
    ///
    /// A region's lease ([`RegionalBudget::lease`](crate::outbound::RegionalBudget::lease))
    /// also reads its region's spendable allocation, once before the first
    /// refresh and then every `view_max_age / 4`, in the same task: its
    /// refreshes report nothing without it.
    pub fn spawn_refresher(&self) -> JoinHandle<()> {
        let weak: Weak<Shared<C>> = Arc::downgrade(&self.inner);
        let wake = self.inner.wake.clone();
        let refresher = async move {
            loop {
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let lease = RateLease { inner };
                if matches!(lease.refresh().await, Err(LeaseError::Released)) {
                    return;
                }
                let wait = lease.until_next_refresh().max(Duration::from_millis(1));
                drop(lease);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = wake.notified() => {}
                }
            }
        };
        match self.inner.ceiling.clone() {
            Some(ceiling) => tokio::spawn(ceiling.follow(refresher)),
            None => tokio::spawn(refresher),
        }
    }

    /// Stops spending (every later attempt is refused) and then deletes this
    /// instance's grants in Redis, so its share returns at once instead of
    /// at expiry. Call it on a clean shutdown; it is final: for a lease
    /// length after it, a refresh of this lease that reaches Redis late (sent
    /// on a connection that hung) changes nothing there. A new lease under
    /// the same instance id is not held back by it.
    pub async fn release(&self) -> Result<(), LeaseError> {
        {
            let mut s = self.inner.state.lock();
            let before = s.shape();
            s.phase = Phase::Released;
            s.grant = Rate::ZERO;
            s.until = Timestamp(0);
            (s.kept, s.kept_until) = (Rate::ZERO, Timestamp(0));
            s.bucket.clear();
            let now = Timestamp::now(&self.inner.clock);
            s.note_change(before, now);
        }
        self.inner.wake.notify_one();
        self.inner.ready.send_replace(true);
        // A refresh in flight finishes first (its reply is ignored), so the
        // release is the last word on this instance.
        let _one = self.inner.refreshing.lock().await;
        let inner = &self.inner;
        inner
            .store
            .release(&inner.key, &inner.id, inner.life, inner.settings().lease_us)
            .await
    }
}

/// A refresh sent at `sent_at` and not finished yet. Dropped before its
/// reply (an outer timeout, an aborted refresher), it finishes as a failed
/// refresh: still holding the refresh lock, so before the next one starts.
pub(super) struct UnfinishedRefresh<'a, C: Clock> {
    pub(super) lease: &'a RateLease<C>,
    pub(super) sent_at: Timestamp,
}

impl<C: Clock> Drop for UnfinishedRefresh<'_, C> {
    fn drop(&mut self) {
        let dropped = LeaseError::Failed {
            message: "the refresh was dropped before its reply".to_owned(),
        };
        let _ = self.lease.finish(self.sent_at, Err(dropped));
    }
}
