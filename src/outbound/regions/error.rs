//! [`RegionError`], the one error of the regions, and the transfer step
//! it is reported at.

use std::fmt;

use super::MAX_ID;

/// The step of a transfer at which a Redis call failed: named in
/// [`RegionError::Unreachable`]'s message, and telling whether the donor is
/// debited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    /// Step 1, on the donor's Redis. Nothing is in flight unless the
    /// outcome is unknown.
    Debit,
    /// Step 2, on the receiver's Redis. The donor **has been debited**: the
    /// amount is in flight until a repair credits it.
    Credit,
    /// Reading before any change: the receiver's epoch before a transfer's
    /// debit, or the debit records for a repair; nothing was changed.
    Lookup,
    /// Giving back a debit the receiver refuses for good (it was credited
    /// under the same id from an earlier state of the donor). The donor is
    /// debited until a repair gives it back.
    Refund,
}

impl Step {
    /// True if a failure at this step leaves the donor debited, or possibly
    /// debited when the call's outcome is unknown.
    pub(super) fn debited(self, outcome_unknown: bool) -> bool {
        match self {
            Step::Credit | Step::Refund => true,
            Step::Debit => outcome_unknown,
            Step::Lookup => false,
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Debit => "debit",
            Step::Credit => "credit",
            Step::Lookup => "lookup",
            Step::Refund => "refund",
        })
    }
}

/// Why an operation on a [`RegionalBudget`](super::RegionalBudget) failed:
/// a transfer, a repair, a read, initializing or recovering regions.
///
/// Each error names the region. A transfer's error also says whether the
/// amount is, or may be, in flight: [`needs_repair`](Self::needs_repair).
///
/// ```no_run
/// # use tower_admission::outbound::{RegionError, RegionalBudget};
/// # async fn run(budget: RegionalBudget) -> Result<(), Box<dyn std::error::Error>> {
/// let id = "rebalance-7-eu-us";
/// match budget.transfer(id, "eu", "us", 500).await {
///     Err(RegionError::Insufficient { available, .. }) => println!("eu has {available}"),
///     Err(e) if e.needs_repair() => {
///         budget.repair(id).await?; // the debit happened, or may have; finish it later
///     }
///     other => println!("{other:?}"),
/// }
/// match budget.allocation("eu").await {
///     Ok(a) => println!("eu: {a}"),
///     Err(RegionError::Unreachable { message, .. }) => eprintln!("eu is down: {message}"),
///     Err(e) => eprintln!("{e}"),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RegionError {
    /// A transfer's amount was 0. Nothing was sent.
    ZeroAmount,
    /// A transfer id is not 1 to 128 printable ASCII characters without
    /// spaces, or starts with `~`, which names ordered transfers
    /// ([`RegionalBudget::send`](super::RegionalBudget::send)). Nothing was
    /// sent.
    InvalidId {
        /// The id given.
        id: String,
    },
    /// The donor and the receiver are the same region. Nothing was sent.
    SameRegion {
        /// The region.
        region: String,
    },
    /// A region is not in the budget. Nothing was sent.
    UnknownRegion {
        /// The name given.
        region: String,
    },
    /// The donor holds less than the amount; nothing changed.
    Insufficient {
        /// The donor.
        region: String,
        /// What the donor holds.
        available: u64,
        /// The amount asked for.
        requested: u64,
    },
    /// A region's Redis did not answer within the call deadline, or the
    /// connection failed.
    Unreachable {
        /// The region whose Redis failed.
        region: String,
        /// True if a transfer's donor has been debited (the credit, or the
        /// giving back of a debit, failed), or may have been (the debit's
        /// outcome is unknown): the amount is, or may be, in flight until a
        /// repair.
        debited: bool,
        /// True if the call may have been applied (it was sent, then timed
        /// out or lost its connection); false if it certainly was not.
        outcome_unknown: bool,
        /// What failed, and for a transfer at which step (`debit`,
        /// `credit`, `lookup` or `refund`).
        message: String,
    },
    /// These regions have no allocation stored: never initialized, or their
    /// Redis lost its data. Nothing changed in them; see
    /// [`RegionalBudget::recover_lost`](super::RegionalBudget::recover_lost).
    StateLost {
        /// The regions.
        regions: Vec<String>,
        /// True if a transfer's donor has been debited: the receiver was
        /// found without state at the credit step, and the amount is in
        /// flight until a repair.
        debited: bool,
    },
    /// The id was already used for a different transfer out of this donor
    /// (another receiver or amount); nothing changed.
    Conflict {
        /// The id.
        id: String,
        /// The donor.
        from: String,
        /// The receiver recorded for the id.
        recorded_to: String,
        /// The amount recorded for the id.
        recorded_amount: u64,
    },
    /// The receiver's state was re-created
    /// ([`RegionalBudget::recover_lost`](super::RegionalBudget::recover_lost))
    /// after this transfer's debit, so the credit is refused, now and on every
    /// retry or repair: the lost state may have received the amount already and
    /// passed it on, and crediting it again could raise the sum above the
    /// total. The donor stays debited and the amount is lost from the sum; the
    /// transfer is dropped from the pending list.
    ReceiverRecreated {
        /// The id.
        id: String,
        /// The donor, debited.
        from: String,
        /// The receiver, never credited.
        to: String,
        /// The amount lost.
        amount: u64,
    },
    /// The donor lost the state that made this debit and was re-seeded at its
    /// initial share
    /// ([`RegionalBudget::initialize`](super::RegionalBudget::initialize))
    /// before the credit landed, so the credit is refused, now and on every
    /// retry or repair: the re-seeded share holds the amount again.
    DonorReseeded {
        /// The id.
        id: String,
        /// The donor, re-seeded.
        from: String,
        /// The receiver, never credited.
        to: String,
        /// The amount.
        amount: u64,
    },
    /// An ordered transfer's number is not the next one of its pair
    /// ([`RegionalBudget::send`](super::RegionalBudget::send)); nothing
    /// changed.
    OutOfOrder {
        /// The donor.
        from: String,
        /// The receiver.
        to: String,
        /// The number given.
        number: u64,
        /// The last number debited in this pair.
        last: u64,
    },
    /// The last ordered transfer of this pair is not yet confirmed: no new
    /// one until [`RegionalBudget::repair_all`](super::RegionalBudget::repair_all)
    /// (or a [`send`](super::RegionalBudget::send) of that number again)
    /// finishes it. Nothing changed.
    InFlight {
        /// The donor.
        from: String,
        /// The receiver.
        to: String,
        /// The unconfirmed number.
        number: u64,
    },
    /// [`RegionalBudget::snapshot`](super::RegionalBudget::snapshot) found no
    /// consistent cut in this many reads (transfers kept completing between
    /// them).
    NotConsistent {
        /// How many times it read.
        attempts: u32,
    },
    /// The allocations sum above the total
    /// ([`RegionalBudget::snapshot`](super::RegionalBudget::snapshot)), or
    /// would once the missing regions were seeded at their initial shares
    /// ([`RegionalBudget::initialize`](super::RegionalBudget::initialize),
    /// which then seeds nothing).
    AboveTotal {
        /// The sum, with the missing regions' shares for `initialize`.
        sum: u64,
        /// The budget's total.
        total: u64,
    },
    /// A Redis reply that the scripts never send (the keys were changed by
    /// something else).
    Malformed {
        /// The region.
        region: String,
        /// What was wrong.
        message: String,
    },
}

impl RegionError {
    /// True if the amount of a transfer is, or may be, in flight after this
    /// error: the donor was debited (the credit or a refund failed), or the
    /// debit's outcome is unknown. [`RegionalBudget::repair`](super::RegionalBudget::repair)
    /// with the same id finishes it.
    ///
    /// ```
    /// use tower_admission::outbound::RegionError;
    /// assert!(!RegionError::ZeroAmount.needs_repair());
    /// ```
    pub fn needs_repair(&self) -> bool {
        match self {
            RegionError::Unreachable { debited, .. } | RegionError::StateLost { debited, .. } => {
                *debited
            }
            _ => false,
        }
    }
}

impl fmt::Display for RegionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegionError::ZeroAmount => f.write_str("a transfer amount must be at least 1"),
            RegionError::InvalidId { id } => write!(
                f,
                "transfer id {id:?} must be 1 to {MAX_ID} printable ASCII characters without spaces, not starting with `~`"
            ),
            RegionError::SameRegion { region } => {
                write!(f, "cannot transfer from region `{region}` to itself")
            }
            RegionError::UnknownRegion { region } => write!(f, "unknown region `{region}`"),
            RegionError::Insufficient {
                region,
                available,
                requested,
            } => write!(
                f,
                "region `{region}` holds {available}, less than the {requested} requested"
            ),
            RegionError::Unreachable {
                region,
                debited,
                outcome_unknown,
                message,
            } => {
                write!(f, "region `{region}` unreachable")?;
                if *outcome_unknown {
                    f.write_str(" (outcome unknown)")?;
                }
                if *debited {
                    f.write_str("; the donor is or may be debited, repair the transfer")?;
                }
                write!(f, ": {message}")
            }
            RegionError::StateLost { regions, debited } => {
                write!(
                    f,
                    "no allocation stored in {} (never initialized, or the data was lost)",
                    regions.join(", ")
                )?;
                if *debited {
                    f.write_str(" at the credit step; the donor is debited, repair the transfer")?;
                }
                Ok(())
            }
            RegionError::Conflict {
                id,
                from,
                recorded_to,
                recorded_amount,
            } => write!(
                f,
                "transfer id `{id}` from `{from}` was already used for {recorded_amount} to `{recorded_to}`"
            ),
            RegionError::ReceiverRecreated {
                id,
                from,
                to,
                amount,
            } => write!(
                f,
                "transfer `{id}` of {amount} from `{from}` can never be credited: `{to}` was re-created after the debit; the amount is lost"
            ),
            RegionError::DonorReseeded {
                id,
                from,
                to,
                amount,
            } => write!(
                f,
                "transfer `{id}` of {amount} to `{to}` can never be credited: `{from}` was re-seeded after losing the state that debited it"
            ),
            RegionError::OutOfOrder {
                from,
                to,
                number,
                last,
            } => write!(
                f,
                "transfer {number} from `{from}` to `{to}` is out of order: the last one was {last}"
            ),
            RegionError::InFlight { from, to, number } => write!(
                f,
                "transfer {number} from `{from}` to `{to}` is not yet confirmed; repair it first"
            ),
            RegionError::NotConsistent { attempts } => write!(
                f,
                "no consistent cut of the regions in {attempts} reads; transfers kept completing between them"
            ),
            RegionError::AboveTotal { sum, total } => write!(
                f,
                "the allocations sum to {sum}, above the total {total}, counting any region still to be seeded at its initial share"
            ),
            RegionError::Malformed { region, message } => {
                write!(f, "unexpected data in region `{region}`: {message}")
            }
        }
    }
}

impl std::error::Error for RegionError {}
