//! A transfer: debit the donor, then credit the receiver, then clear the
//! donor's pending mark, each step idempotent by its id.

use redis::Value;

use super::ledger::{int, parse_debit, text, Credit, DebitReply, Record};
use super::region::{malformed, Region, Unreachable};
use super::{RegionError, RegionalBudget, Step, MAX_ID};

const ORDERED_MARK: char = '~';
use crate::redis::Request;

impl RegionalBudget {
    /// Moves `amount` of allocation from region `from` to region `to`.
    ///
    /// The donor is debited first (atomically, refused if it holds less than
    /// `amount`), and the receiver is credited only after the debit is
    /// confirmed, so the sum of the allocations never exceeds the total.
    /// Calling it again with the same `id` is safe and never moves the
    /// amount twice: it completes a half-done transfer, or does nothing.
    ///
    /// The `id` names this transfer out of `from`: 1 to 128 printable ASCII
    /// characters without spaces, not starting with `~` (reserved for
    /// [ordered transfers](Self::send)). Choose ids that mean something (a
    /// rebalancing round and its pair of regions), or random ones (a UUID)
    /// kept until the transfer is known complete.
    /// If the receiver was re-created after the debit
    /// ([`recover_lost`](Self::recover_lost)), it cannot be completed: the
    /// call fails with [`RegionError::ReceiverRecreated`], and the amount
    /// is lost from the sum.
    ///
    /// Errors: [`RegionError::InvalidId`], [`ZeroAmount`](RegionError::ZeroAmount),
    /// [`UnknownRegion`](RegionError::UnknownRegion)
    /// and [`SameRegion`](RegionError::SameRegion) before any Redis call;
    /// [`Insufficient`](RegionError::Insufficient) and
    /// [`Conflict`](RegionError::Conflict) from the donor, with nothing
    /// changed; [`Unreachable`](RegionError::Unreachable) and
    /// [`StateLost`](RegionError::StateLost), `debited: true` when the
    /// donor is, or may be, debited (at the `lookup` step named in the
    /// message, the receiver could not be read before a new debit, and
    /// nothing changed); [`ReceiverRecreated`](RegionError::ReceiverRecreated).
    /// After a
    /// failed credit the amount is in flight until [`repair`](Self::repair).
    /// So it is when the future is dropped between the two steps (under an
    /// outer timeout, say): call it again with the same `id`, or let
    /// [`repair_all`](Self::repair_all) finish it.
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionalBudget, TransferOutcome};
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let id = "rebalance-2024-06-01T10:00Z-ap-eu";
    /// assert_eq!(budget.transfer(id, "ap", "eu", 20).await?, TransferOutcome::Applied);
    /// // A retry (say, after a timeout) moves nothing more.
    /// assert_eq!(budget.transfer(id, "ap", "eu", 20).await?, TransferOutcome::AlreadyApplied);
    /// assert!(budget.transfer("has space", "ap", "eu", 20).await.is_err());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn transfer(
        &self,
        id: &str,
        from: &str,
        to: &str,
        amount: u64,
    ) -> Result<TransferOutcome, RegionError> {
        let id = &TransferId::parse(id)?;
        if amount == 0 {
            return Err(RegionError::ZeroAmount);
        }
        let unknown = |region: &str| RegionError::UnknownRegion {
            region: region.to_owned(),
        };
        let donor = self.region(from).ok_or_else(|| unknown(from))?;
        let receiver = self.region(to).ok_or_else(|| unknown(to))?;
        if from == to {
            return Err(RegionError::SameRegion {
                region: from.to_owned(),
            });
        }

        // Step 1: the debit, on the donor, bound to the receiver's state as
        // last seen (read first if never seen). Nothing else happens unless
        // it is confirmed.
        let mut to_epoch = receiver.known_epoch().unwrap_or_default();
        let mut reply = self.debit(donor, id, amount, to, &to_epoch).await?;
        if matches!(reply, Some(DebitReply::EpochNeeded)) {
            to_epoch = self.read_epoch(receiver).await?;
            reply = self.debit(donor, id, amount, to, &to_epoch).await?;
        }
        let (record, debited_now) = match reply {
            Some(DebitReply::Now { seq, epoch }) => {
                donor.remember_epoch(Some(&epoch));
                let record = Record {
                    amount,
                    to: to.to_owned(),
                    seq,
                    epoch,
                    to_epoch,
                    refunded: false,
                };
                (record, true)
            }
            Some(DebitReply::Before(record)) => {
                if record.amount != amount || record.to != to {
                    return Err(RegionError::Conflict {
                        id: id.as_str().to_owned(),
                        from: from.to_owned(),
                        recorded_to: record.to,
                        recorded_amount: record.amount,
                    });
                }
                (record, false)
            }
            Some(DebitReply::Refused { available }) => {
                return Err(RegionError::Insufficient {
                    region: from.to_owned(),
                    available,
                    requested: amount,
                })
            }
            Some(DebitReply::Missing) => {
                return Err(RegionError::StateLost {
                    regions: vec![from.to_owned()],
                    debited: false,
                })
            }
            Some(DebitReply::EpochNeeded) | None => {
                return Err(malformed(donor, "unexpected reply to the debit script"))
            }
        };

        // Steps 2 and 3.
        Ok(match self.finish(donor, receiver, id, &record).await? {
            Credit::Now | Credit::Before if debited_now => TransferOutcome::Applied,
            Credit::Now => TransferOutcome::Completed,
            Credit::Before => TransferOutcome::AlreadyApplied,
            Credit::Refunded { credited_earlier } if credited_earlier == amount => {
                TransferOutcome::AlreadyApplied
            }
            Credit::Refunded { credited_earlier } => {
                return Err(RegionError::Conflict {
                    id: id.as_str().to_owned(),
                    from: from.to_owned(),
                    recorded_to: to.to_owned(),
                    recorded_amount: credited_earlier,
                })
            }
        })
    }

    /// Step 1: runs the debit script; `to_epoch` empty only looks the id up.
    pub(super) async fn debit(
        &self,
        donor: &Region,
        id: &TransferId,
        amount: u64,
        to: &str,
        to_epoch: &str,
    ) -> Result<Option<DebitReply>, RegionError> {
        let mut invocation = self.inner.debit.prepare_invoke();
        invocation
            .key(&donor.state_key)
            .key(&donor.debits_key)
            .key(&donor.pending_key)
            .arg(id.as_str())
            .arg(amount)
            .arg(to)
            .arg(to_epoch);
        let reply = self
            .call(donor, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(donor, Step::Debit))?;
        Ok(parse_debit(reply))
    }

    /// Reads the epoch of `region`'s state. A new debit to a receiver whose
    /// state cannot be read is not made.
    pub(super) async fn read_epoch(&self, region: &Region) -> Result<String, RegionError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(&region.state_key).arg("epoch");
        let reply = self
            .call(region, Request::Cmd(&cmd))
            .await
            .map_err(|e| e.into_transfer(region, Step::Lookup))?;
        match reply {
            Value::Nil => {
                region.remember_epoch(None);
                Err(RegionError::StateLost {
                    regions: vec![region.name.to_string()],
                    debited: false,
                })
            }
            value => {
                let epoch = text(&value).ok_or_else(|| malformed(region, "unreadable epoch"))?;
                region.remember_epoch(Some(&epoch));
                Ok(epoch)
            }
        }
    }

    /// Steps 2 and 3 for a confirmed debit: credits it (or gives it back,
    /// see [`Credit::Refunded`]), then clears its pending mark. A debit the
    /// receiver refuses for good is dropped from the pending list.
    pub(super) async fn finish(
        &self,
        donor: &Region,
        receiver: &Region,
        id: &TransferId,
        record: &Record,
    ) -> Result<Credit, RegionError> {
        if record.refunded {
            return Ok(Credit::Refunded {
                credited_earlier: record.amount,
            });
        }
        let credit = match self.credit(donor, receiver, id, record).await {
            Ok(Credit::Refunded { credited_earlier }) => {
                self.refund(donor, id, record).await?;
                return Ok(Credit::Refunded { credited_earlier });
            }
            Err(e @ RegionError::DonorReseeded { .. }) => {
                tracing::warn!(
                    from = &*donor.name,
                    to = &*receiver.name,
                    id = id.as_str(),
                    amount = record.amount,
                    "the donor was re-seeded after losing the state that made this debit: never credited"
                );
                Err(e)
            }
            Err(e @ RegionError::ReceiverRecreated { .. }) => {
                tracing::warn!(
                    from = &*donor.name,
                    to = &*receiver.name,
                    id = id.as_str(),
                    amount = record.amount,
                    "the receiver was re-created after this debit: never credited, the amount is lost"
                );
                Err(e)
            }
            Err(e) => return Err(e),
            credited => credited,
        };
        // Step 3: clear the pending mark; a failure leaves a stale mark that
        // repair_all clears.
        self.settle(donor, id).await;
        credit
    }

    /// Step 2: credits `record` to `receiver`, in the receiver state the
    /// debit was bound to and at most once per donor state and id.
    pub(super) async fn credit(
        &self,
        donor: &Region,
        receiver: &Region,
        id: &TransferId,
        record: &Record,
    ) -> Result<Credit, RegionError> {
        if let Some((_, n)) = id.as_ordered() {
            return self.receive(donor, receiver, n, record).await;
        }
        let mut invocation = self.inner.credit.prepare_invoke();
        invocation
            .key(&receiver.state_key)
            .key(&receiver.credits_key)
            .arg(&*donor.name)
            .arg(id.as_str())
            .arg(record.amount)
            .arg(record.seq)
            .arg(&record.epoch)
            .arg(&record.to_epoch);
        let reply = self
            .call(receiver, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(receiver, Step::Credit))?;
        let unexpected = || malformed(receiver, "unexpected credit reply");
        let Value::Array(items) = reply else {
            return Err(unexpected());
        };
        let code = items.first().and_then(int).ok_or_else(unexpected)?;
        let amount = || {
            items
                .get(1)
                .and_then(int)
                .and_then(|a| u64::try_from(a).ok())
                .ok_or_else(unexpected)
        };
        match code {
            1 => Ok(Credit::Now),
            2 if amount()? == record.amount => Ok(Credit::Before),
            2 => Err(RegionError::Conflict {
                id: id.as_str().to_owned(),
                from: donor.name.to_string(),
                recorded_to: receiver.name.to_string(),
                recorded_amount: amount()?,
            }),
            3 => Ok(Credit::Refunded {
                credited_earlier: amount()?,
            }),
            -3..=-1 => Err(refused_credit(code, &items, donor, receiver, id, record)
                .unwrap_or_else(unexpected)),
            _ => Err(unexpected()),
        }
    }

    /// Gives back a debit that the receiver refuses for good because it
    /// holds a credit under the same id from an earlier state of the donor.
    pub(super) async fn refund(
        &self,
        donor: &Region,
        id: &TransferId,
        record: &Record,
    ) -> Result<(), RegionError> {
        let mut invocation = self.inner.refund.prepare_invoke();
        invocation
            .key(&donor.state_key)
            .key(&donor.debits_key)
            .key(&donor.pending_key)
            .arg(id.as_str())
            .arg(record.as_written());
        let reply = self
            .call(donor, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(donor, Step::Refund))?;
        match int(&reply) {
            // 0: given back already, or the record left with a state loss.
            Some(0 | 1) => Ok(()),
            _ => Err(malformed(donor, "unexpected reply to the refund script")),
        }
    }

    /// Step 3, best effort: drops `id` from the donor's pending debits.
    pub(super) async fn settle(&self, donor: &Region, id: &TransferId) {
        let mut cmd = redis::cmd("HDEL");
        cmd.arg(&donor.pending_key).arg(id.as_str());
        if let Err(e) = self.call(donor, Request::Cmd(&cmd)).await {
            tracing::warn!(
                region = &*donor.name,
                id = id.as_str(),
                error = %e,
                "could not clear a completed transfer from the pending list; repair_all clears it"
            );
        }
    }
}

/// The error for a credit refused for good (codes -1 to -3 of the credit
/// scripts); `None` for another reply.
pub(super) fn refused_credit(
    code: i64,
    items: &[Value],
    donor: &Region,
    receiver: &Region,
    id: &TransferId,
    record: &Record,
) -> Option<RegionError> {
    match code {
        -1 => {
            receiver.remember_epoch(None);
            Some(RegionError::StateLost {
                regions: vec![receiver.name.to_string()],
                debited: true,
            })
        }
        -2 => {
            let epoch = items.get(1).and_then(text)?;
            receiver.remember_epoch(Some(&epoch));
            Some(RegionError::ReceiverRecreated {
                id: id.as_str().to_owned(),
                from: donor.name.to_string(),
                to: receiver.name.to_string(),
                amount: record.amount,
            })
        }
        -3 => Some(RegionError::DonorReseeded {
            id: id.as_str().to_owned(),
            from: donor.name.to_string(),
            to: receiver.name.to_string(),
            amount: record.amount,
        }),
        _ => None,
    }
}

/// A transfer id, checked: the name of one transfer out of one donor
/// region, which both steps record (see [`RegionalBudget::transfer`]).
/// Ordered transfers ([`RegionalBudget::send`]) are named `~to~n` in a
/// donor's pending list, so a caller's id never starts with `~`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct TransferId(Box<str>);

impl TransferId {
    /// A caller's id: 1 to 128 printable ASCII characters (no spaces), not
    /// starting with `~`.
    pub(super) fn parse(id: &str) -> Result<Self, RegionError> {
        match TransferId::stored(id) {
            Some(id) if !id.0.starts_with(ORDERED_MARK) => Ok(id),
            _ => Err(RegionError::InvalidId { id: id.to_owned() }),
        }
    }

    /// The id of the `n`-th ordered transfer toward `to` (one donor's
    /// pending list names it so).
    pub(super) fn ordered(to: &str, n: u64) -> Self {
        TransferId(format!("{ORDERED_MARK}{to}{ORDERED_MARK}{n}").into())
    }

    /// `(receiver, n)` if this names an ordered transfer.
    pub(super) fn as_ordered(&self) -> Option<(&str, u64)> {
        let rest = self.0.strip_prefix(ORDERED_MARK)?;
        let (to, n) = rest.split_once(ORDERED_MARK)?;
        Some((to, n.parse().ok()?))
    }

    /// An id as stored in a pending list, ordered ones included.
    pub(super) fn stored(id: &str) -> Option<Self> {
        let plain = id.len() <= MAX_ID && id.bytes().all(|b| b.is_ascii_graphic());
        (!id.is_empty() && plain).then(|| TransferId(id.into()))
    }

    pub(super) fn as_str(&self) -> &str {
        &self.0
    }
}

/// What a successful [`RegionalBudget::transfer`] or
/// [`RegionalBudget::repair`] did. Except for
/// [`NothingDebited`](Self::NothingDebited) (a repair of an id no region
/// debited), the amount has moved exactly once.
///
/// ```
/// use tower_admission::outbound::TransferOutcome;
/// assert_ne!(TransferOutcome::Applied, TransferOutcome::AlreadyApplied);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TransferOutcome {
    /// This call debited the donor; the receiver is credited (by this call,
    /// or by a concurrent call or repair with the same id).
    Applied,
    /// An earlier call had debited the donor; this call made the missing
    /// credit.
    Completed,
    /// The transfer had been fully applied before; nothing changed (a debit
    /// made again after the donor's state loss was given back).
    AlreadyApplied,
    /// From [`RegionalBudget::repair`] only: no region has debited this id,
    /// so nothing is in flight under it (a refused transfer, a debit that
    /// never reached the donor, or an id never used).
    NothingDebited,
}
