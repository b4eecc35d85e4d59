//! Finding and finishing half-done transfers.

use std::collections::HashMap;

use futures_util::future::join_all;
use redis::Value;

use super::ledger::{text, Credit, Record};
use super::region::{malformed, Region, Unreachable};
use super::{RegionError, RegionalBudget, Step, TransferId, TransferOutcome};
use crate::redis::{CallError, Request};

impl RegionalBudget {
    /// Every debit whose credit is not yet confirmed, from all regions: the
    /// transfers in flight, or interrupted and waiting for
    /// [`repair_all`](Self::repair_all).
    ///
    /// A transfer whose credit has been applied but not yet settled on the
    /// donor is listed too; repairing it changes nothing but the list.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::RegionalBudget;
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for p in budget.pending().await? {
    ///     println!("{}: {} from {} to {}", p.id(), p.amount(), p.from(), p.to());
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn pending(&self) -> Result<Vec<PendingTransfer>, RegionError> {
        let mut all = Vec::new();
        for region in &self.inner.regions {
            let records = self
                .pending_of(region)
                .await
                .map_err(|e| e.into_region(region))?;
            all.extend(records.into_iter().map(|(p, _)| p));
        }
        Ok(all)
    }

    /// Finishes transfer `id` if it was debited but not credited; never
    /// credits twice, so it is safe to call at any time, concurrently with
    /// the transfer itself, and as often as needed.
    ///
    /// The debit record is looked up in every region (an id names one
    /// transfer per donor; if several donors recorded the same id, each is
    /// finished). Every region must answer the lookup. A transfer whose
    /// receiver was re-created after its debit is never credited: this
    /// returns [`RegionError::ReceiverRecreated`] and drops it from the
    /// pending list.
    ///
    /// The answer is [`TransferOutcome::Completed`] (this call credited
    /// it), [`TransferOutcome::AlreadyApplied`] (debited and credited
    /// already; nothing changed) or [`TransferOutcome::NothingDebited`]; an
    /// id no pending list could hold is [`RegionError::InvalidId`].
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionalBudget, TransferOutcome};
    /// # async fn run(budget: RegionalBudget, id: &str) -> Result<(), Box<dyn std::error::Error>> {
    /// match budget.repair(id).await? {
    ///     TransferOutcome::Completed => println!("credited now"),
    ///     TransferOutcome::AlreadyApplied => println!("nothing was missing"),
    ///     TransferOutcome::NothingDebited => println!("no region debited {id}"),
    ///     _ => {}
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn repair(&self, id: &str) -> Result<TransferOutcome, RegionError> {
        // Any id a pending list holds, ordered ones included.
        let id =
            &TransferId::stored(id).ok_or_else(|| RegionError::InvalidId { id: id.to_owned() })?;
        let lookups = join_all(self.inner.regions.iter().map(|donor| async move {
            let mut cmd = redis::cmd("HGET");
            cmd.arg(&donor.debits_key).arg(id.as_str());
            self.call(donor, Request::Cmd(&cmd)).await
        }))
        .await;
        let mut found = Vec::new();
        for (donor, lookup) in self.inner.regions.iter().zip(lookups) {
            match lookup.map_err(|e| e.into_transfer(donor, Step::Lookup))? {
                Value::Nil => {}
                value => {
                    let record = text(&value)
                        .and_then(|s| Record::parse(&s))
                        .ok_or_else(|| malformed(donor, "unreadable debit record"))?;
                    found.push((donor, record));
                }
            }
        }
        if found.is_empty() {
            return Ok(TransferOutcome::NothingDebited);
        }
        let mut completed = false;
        for (donor, record) in found {
            let receiver = self
                .region(&record.to)
                .ok_or_else(|| RegionError::UnknownRegion {
                    region: record.to.clone(),
                })?;
            completed |= matches!(
                self.finish(donor, receiver, id, &record).await?,
                Credit::Now
            );
        }
        Ok(if completed {
            TransferOutcome::Completed
        } else {
            TransferOutcome::AlreadyApplied
        })
    }

    /// Repairs every pending transfer of every region (see
    /// [`pending`](Self::pending) and [`repair`](Self::repair)); never
    /// credits twice. It goes on past failures and answers one result per
    /// pending transfer, in each donor's order of debits:
    /// [`TransferOutcome::Completed`] (credited by this call),
    /// [`TransferOutcome::AlreadyApplied`] (credited before, so only its
    /// pending mark was cleared, or debited again after the donor's state
    /// loss and given back), or the error; plus an error for each region
    /// whose pending list could not be read. A failed transfer stays pending
    /// for a later repair, except one whose receiver was re-created after its
    /// debit: [`RegionError::ReceiverRecreated`], reported once, since it is
    /// dropped from the pending list.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionalBudget, TransferOutcome};
    /// # async fn run(budget: RegionalBudget) {
    /// let results = budget.repair_all().await;
    /// let completed = results.iter().filter(|r| **r == Ok(TransferOutcome::Completed)).count();
    /// println!("{completed} completed");
    /// for e in results.iter().filter_map(|r| r.as_ref().err()) {
    ///     eprintln!("{e}");
    /// }
    /// # }
    /// ```
    pub async fn repair_all(&self) -> Vec<Result<TransferOutcome, RegionError>> {
        let mut results = Vec::new();
        for donor in &self.inner.regions {
            let records = match self.pending_of(donor).await {
                Ok(records) => records,
                Err(e) => {
                    results.push(Err(e.into_transfer(donor, Step::Lookup)));
                    continue;
                }
            };
            for (pending, record) in records {
                let Some(receiver) = self.region(&record.to) else {
                    results.push(Err(RegionError::UnknownRegion {
                        region: record.to.clone(),
                    }));
                    continue;
                };
                results.push(
                    match self.finish(donor, receiver, &pending.id, &record).await {
                        Ok(Credit::Now) => Ok(TransferOutcome::Completed),
                        Ok(Credit::Before | Credit::Refunded { .. }) => {
                            Ok(TransferOutcome::AlreadyApplied)
                        }
                        Err(e) => Err(e),
                    },
                );
            }
        }
        results
    }

    pub(super) async fn pending_of(
        &self,
        donor: &Region,
    ) -> Result<Vec<(PendingTransfer, Record)>, CallError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(&donor.pending_key);
        let reply = self.call(donor, Request::Cmd(&cmd)).await?;
        let map: HashMap<String, String> = redis::from_redis_value(reply).map_err(|e| {
            // Read only: known not applied.
            CallError::Rejected(format!("unreadable pending list: {e}"))
        })?;
        let mut out: Vec<(PendingTransfer, Record)> = map
            .into_iter()
            .filter_map(|(id, rec)| {
                let parsed = Record::parse(&rec).zip(TransferId::stored(id.as_str()));
                if parsed.is_none() {
                    tracing::warn!(
                        region = &*donor.name,
                        id,
                        record = rec,
                        "skipping an unreadable pending record"
                    );
                }
                let (record, id) = parsed?;
                let pending = PendingTransfer {
                    id,
                    from: donor.name.to_string(),
                    to: record.to.clone(),
                    amount: record.amount,
                };
                Some((pending, record))
            })
            .collect();
        out.sort_by_key(|a| a.1.seq);
        Ok(out)
    }
}

/// A debit whose credit is not yet confirmed, from
/// [`RegionalBudget::pending`].
///
/// ```no_run
/// # use tower_admission::outbound::RegionalBudget;
/// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
/// let in_flight: u64 = budget.pending().await?.iter().map(|p| p.amount()).sum();
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingTransfer {
    id: TransferId,
    from: String,
    to: String,
    amount: u64,
}

impl PendingTransfer {
    /// The transfer's id.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// for p in budget.pending().await? { budget.repair(p.id()).await?; }
    /// # Ok(())
    /// # }
    /// ```
    pub fn id(&self) -> &str {
        self.id.as_str()
    }

    /// The donor region, already debited.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let donors: Vec<String> = budget.pending().await?.iter().map(|p| p.from().to_owned()).collect();
    /// # Ok(())
    /// # }
    /// ```
    pub fn from(&self) -> &str {
        &self.from
    }

    /// The receiver region.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let receivers: Vec<String> = budget.pending().await?.iter().map(|p| p.to().to_owned()).collect();
    /// # Ok(())
    /// # }
    /// ```
    pub fn to(&self) -> &str {
        &self.to
    }

    /// The amount in flight.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let amounts: Vec<u64> = budget.pending().await?.iter().map(|p| p.amount()).collect();
    /// # Ok(())
    /// # }
    /// ```
    pub fn amount(&self) -> u64 {
        self.amount
    }
}
