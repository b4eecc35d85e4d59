//! Ordered transfers: the n-th move from one region to another, with
//! bounded records (a watermark per pair instead of one field per id), and
//! the credit hold that keeps received allocation unspent until the donor's
//! old grants have expired. The proof is in `docs/regions.md`.

use redis::Value;

use super::ledger::{int, text, Credit, Record};
use super::region::{malformed, Region, Unreachable};
use super::transfer::refused_credit;
use super::{RegionError, RegionalBudget, Step, TransferId, TransferOutcome};
use crate::redis::Request;

/// What the donor answered about one number of a pair.
enum SendReply {
    Now { seq: u64, epoch: String },
    Last { record: Record, pending: bool },
    Compacted,
    Refused { available: u64 },
    Missing,
    EpochNeeded,
    OutOfOrder { last: u64 },
    InFlight { last: u64 },
}

impl RegionalBudget {
    /// The number the next ordered transfer from `from` to `to` must carry:
    /// one above the last debited in this pair (1 for the first).
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let n = budget.next_number("ap", "eu").await?;
    /// budget.send("ap", "eu", n, 20).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn next_number(&self, from: &str, to: &str) -> Result<u64, RegionError> {
        let (donor, _) = self.pair(from, to)?;
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(&donor.state_key)
            .arg("alloc")
            .arg(format!("out:{to}"));
        let reply = self
            .call(donor, Request::Cmd(&cmd))
            .await
            .map_err(|e| e.into_transfer(donor, Step::Lookup))?;
        let (alloc, last): (Option<u64>, Option<u64>) =
            redis::from_redis_value(reply).map_err(|_| malformed(donor, "unreadable state"))?;
        if alloc.is_none() {
            return Err(RegionError::StateLost {
                regions: vec![from.to_owned()],
                debited: false,
            });
        }
        let last = last.unwrap_or(0);
        Ok(last + 1)
    }

    /// Moves `amount` from `from` to `to` as the `n`-th transfer of this pair
    /// (see [`next_number`](Self::next_number)): the donor is debited first,
    /// the receiver credited only after, as in [`transfer`](Self::transfer),
    /// but with records that stay bounded however many transfers run.
    ///
    /// The pair's transfers are strictly ordered: `n` must be one above the
    /// last ([`RegionError::OutOfOrder`]), and no new one is debited while
    /// the last is unconfirmed ([`RegionError::InFlight`]): at most one
    /// amount per pair is ever in flight. Calling it again with the same `n`
    /// finishes it or does nothing ([`TransferOutcome::AlreadyApplied`]); a
    /// number below the last is answered
    /// [`TransferOutcome::AlreadyApplied`] without any record. The donor
    /// gives only what it may spend: its allocation less what it received
    /// less than [`credit_hold`](super::RegionalBudgetBuilder::credit_hold)
    /// ago. A transfer left half done is finished by
    /// [`repair_all`](Self::repair_all).
    ///
    /// ```no_run
    /// # use tower_admission::outbound::{RegionalBudget, TransferOutcome};
    /// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let n = budget.next_number("ap", "eu").await?;
    /// assert_eq!(budget.send("ap", "eu", n, 20).await?, TransferOutcome::Applied);
    /// assert_eq!(budget.send("ap", "eu", n, 20).await?, TransferOutcome::AlreadyApplied);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn send(
        &self,
        from: &str,
        to: &str,
        n: u64,
        amount: u64,
    ) -> Result<TransferOutcome, RegionError> {
        if amount == 0 {
            return Err(RegionError::ZeroAmount);
        }
        let (donor, receiver) = self.pair(from, to)?;
        let id = TransferId::ordered(to, n);
        // A new debit is bound to the receiver's state read just before it,
        // never to a remembered one: a debit bound to a state lost since
        // would never be credited.
        let mut to_epoch = String::new();
        let mut reply = self.send_debit(donor, to, n, amount, &to_epoch).await?;
        if matches!(reply, SendReply::EpochNeeded) {
            to_epoch = self.read_epoch(receiver).await?;
            reply = self.send_debit(donor, to, n, amount, &to_epoch).await?;
        }
        let (record, debited_now) = match reply {
            SendReply::Now { seq, epoch } => {
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
            SendReply::Last { record, pending } => {
                if record.amount != amount {
                    return Err(RegionError::Conflict {
                        id: id.as_str().to_owned(),
                        from: from.to_owned(),
                        recorded_to: record.to,
                        recorded_amount: record.amount,
                    });
                }
                if !pending {
                    return Ok(TransferOutcome::AlreadyApplied);
                }
                (record, false)
            }
            SendReply::Compacted => return Ok(TransferOutcome::AlreadyApplied),
            SendReply::Refused { available } => {
                return Err(RegionError::Insufficient {
                    region: from.to_owned(),
                    available,
                    requested: amount,
                })
            }
            SendReply::Missing => {
                return Err(RegionError::StateLost {
                    regions: vec![from.to_owned()],
                    debited: false,
                })
            }
            SendReply::OutOfOrder { last } => {
                return Err(RegionError::OutOfOrder {
                    from: from.to_owned(),
                    to: to.to_owned(),
                    number: n,
                    last,
                })
            }
            SendReply::InFlight { last } => {
                return Err(RegionError::InFlight {
                    from: from.to_owned(),
                    to: to.to_owned(),
                    number: last,
                })
            }
            SendReply::EpochNeeded => {
                return Err(malformed(donor, "unexpected reply to the send script"))
            }
        };
        Ok(match self.finish(donor, receiver, &id, &record).await? {
            Credit::Now | Credit::Before if debited_now => TransferOutcome::Applied,
            Credit::Now => TransferOutcome::Completed,
            Credit::Before | Credit::Refunded { .. } => TransferOutcome::AlreadyApplied,
        })
    }

    /// Reads what `region`'s leases may grant now: its allocation less what
    /// it received less than the credit hold ago (on its Redis clock). The
    /// rest of its [`allocation`](Self::allocation) is held.
    ///
    /// ```no_run
    /// # async fn run(budget: tower_admission::outbound::RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
    /// let spendable = budget.spendable("eu").await?;
    /// println!("eu may spend {spendable}");
    /// # Ok(())
    /// # }
    /// ```
    pub async fn spendable(&self, region: &str) -> Result<u64, RegionError> {
        let region = self.known_region(region)?;
        let mut invocation = self.inner.view.prepare_invoke();
        invocation.key(&region.state_key).arg(self.inner.hold_us);
        let reply = self
            .call(region, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_region(region))?;
        let bad = || RegionError::Malformed {
            region: region.name.to_string(),
            message: "unexpected reply to the view script".to_owned(),
        };
        let Value::Array(items) = reply else {
            return Err(bad());
        };
        let number = |i: usize| {
            items
                .get(i)
                .and_then(int)
                .and_then(|v| u64::try_from(v).ok())
        };
        if items.first().and_then(int) == Some(-1) {
            return Err(RegionError::StateLost {
                regions: vec![region.name.to_string()],
                debited: false,
            });
        }
        let allocation = number(0).ok_or_else(bad)?;
        let held = number(1).ok_or_else(bad)?;
        if let Some(epoch) = items.get(3).and_then(text) {
            region.remember_epoch(Some(&epoch));
        }
        Ok(allocation.saturating_sub(held))
    }

    /// Step 2 of an ordered transfer: credits `record` once, by the pair's
    /// watermark.
    pub(super) async fn receive(
        &self,
        donor: &Region,
        receiver: &Region,
        n: u64,
        record: &Record,
    ) -> Result<Credit, RegionError> {
        let mut invocation = self.inner.receive.prepare_invoke();
        invocation
            .key(&receiver.state_key)
            .arg(&*donor.name)
            .arg(n)
            .arg(record.amount)
            .arg(record.seq)
            .arg(&record.epoch)
            .arg(&record.to_epoch)
            .arg(self.inner.hold_us);
        let reply = self
            .call(receiver, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(receiver, Step::Credit))?;
        let unexpected = || malformed(receiver, "unexpected reply to the receive script");
        let Value::Array(items) = reply else {
            return Err(unexpected());
        };
        match items.first().and_then(int).ok_or_else(unexpected)? {
            1 => Ok(Credit::Now),
            2 => Ok(Credit::Before),
            code => {
                let id = TransferId::ordered(&receiver.name, n);
                Err(refused_credit(code, &items, donor, receiver, &id, record)
                    .unwrap_or_else(unexpected))
            }
        }
    }

    async fn send_debit(
        &self,
        donor: &Region,
        to: &str,
        n: u64,
        amount: u64,
        to_epoch: &str,
    ) -> Result<SendReply, RegionError> {
        let mut invocation = self.inner.send.prepare_invoke();
        invocation
            .key(&donor.state_key)
            .key(&donor.pending_key)
            .arg(to)
            .arg(n)
            .arg(amount)
            .arg(to_epoch)
            .arg(self.inner.hold_us);
        let reply = self
            .call(donor, Request::Script(&invocation))
            .await
            .map_err(|e| e.into_transfer(donor, Step::Debit))?;
        let unexpected = || malformed(donor, "unexpected reply to the send script");
        let Value::Array(items) = reply else {
            return Err(unexpected());
        };
        let number = |i: usize| {
            items
                .get(i)
                .and_then(int)
                .and_then(|v| u64::try_from(v).ok())
                .ok_or_else(unexpected)
        };
        Ok(match items.first().and_then(int).ok_or_else(unexpected)? {
            1 => SendReply::Now {
                seq: number(1)?,
                epoch: items.get(2).and_then(text).ok_or_else(unexpected)?,
            },
            2 => SendReply::Last {
                record: items
                    .get(1)
                    .and_then(text)
                    .and_then(|r| Record::parse(&r))
                    .ok_or_else(unexpected)?,
                pending: number(2)? == 1,
            },
            4 => SendReply::Compacted,
            0 => SendReply::Refused {
                available: number(1)?,
            },
            -1 => SendReply::Missing,
            -2 => SendReply::EpochNeeded,
            -3 => SendReply::OutOfOrder { last: number(1)? },
            -4 => SendReply::InFlight { last: number(1)? },
            _ => return Err(unexpected()),
        })
    }

    fn pair(&self, from: &str, to: &str) -> Result<(&Region, &Region), RegionError> {
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
        Ok((donor, receiver))
    }
}
