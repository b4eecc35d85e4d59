//! One region: its Redis (a connection through the crate's one Redis call
//! module), its keys, the epoch of its state as last seen, and how a failed
//! call on it is reported.

use redis::Value;

use super::ledger::{int, text};
use super::{RegionError, RegionalBudget, Step};
use crate::redis::{CallError, Connector, Request};

/// One region: its Redis, its keys and its connection slot.
pub(super) struct Region {
    pub(super) name: Box<str>,
    pub(super) initial: u64,
    pub(super) connector: Connector,
    pub(super) state_key: String,
    pub(super) debits_key: String,
    pub(super) pending_key: String,
    pub(super) credits_key: String,
    /// The epoch of the region's state as last seen; a new debit to this
    /// region is bound to it.
    pub(super) epoch: std::sync::Mutex<Option<String>>,
}

impl Region {
    pub(super) fn known_epoch(&self) -> Option<String> {
        self.epoch.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records the epoch just read from this region; `None` if its state is
    /// missing.
    pub(super) fn remember_epoch(&self, epoch: Option<&str>) {
        *self.epoch.lock().unwrap_or_else(|e| e.into_inner()) = epoch.map(str::to_owned);
    }
}

/// A failed call as the error of a transfer step or of a region.
pub(super) trait Unreachable {
    fn into_transfer(self, region: &Region, step: Step) -> RegionError;
    fn into_region(self, region: &Region) -> RegionError;
}

impl Unreachable for CallError {
    fn into_transfer(self, region: &Region, step: Step) -> RegionError {
        let outcome_unknown = self.outcome_unknown();
        RegionError::Unreachable {
            region: region.name.to_string(),
            debited: step.debited(outcome_unknown),
            outcome_unknown,
            message: format!("at the {step} step: {self}"),
        }
    }

    fn into_region(self, region: &Region) -> RegionError {
        RegionError::Unreachable {
            region: region.name.to_string(),
            debited: false,
            outcome_unknown: self.outcome_unknown(),
            message: self.to_string(),
        }
    }
}

pub(super) fn malformed(region: &Region, message: &str) -> RegionError {
    RegionError::Malformed {
        region: region.name.to_string(),
        message: message.to_owned(),
    }
}

impl RegionalBudget {
    /// One Redis call on `region` under the call deadline, connecting first
    /// if needed.
    pub(super) async fn call(
        &self,
        region: &Region,
        request: Request<'_>,
    ) -> Result<Value, CallError> {
        region.connector.call(request).await
    }

    /// `field` of `region`'s state, which must exist.
    pub(super) async fn state_field(
        &self,
        region: &Region,
        field: &str,
    ) -> Result<Value, RegionError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(&region.state_key).arg(field);
        let reply = self
            .call(region, Request::Cmd(&cmd))
            .await
            .map_err(|e| e.into_region(region))?;
        match reply {
            Value::Nil => Err(RegionError::StateLost {
                regions: vec![region.name.to_string()],
                debited: false,
            }),
            value => Ok(value),
        }
    }

    /// The epoch of `region`'s state, which must exist.
    pub(super) async fn live_epoch(&self, region: &Region) -> Result<String, RegionError> {
        let value = self.state_field(region, "epoch").await?;
        let epoch = text(&value).ok_or_else(|| RegionError::Malformed {
            region: region.name.to_string(),
            message: "unreadable epoch".to_owned(),
        })?;
        region.remember_epoch(Some(&epoch));
        Ok(epoch)
    }

    pub(super) async fn read_allocation(&self, region: &Region) -> Result<u64, RegionError> {
        let value = self.state_field(region, "alloc").await?;
        int(&value)
            .and_then(|a| u64::try_from(a).ok())
            .ok_or_else(|| RegionError::Malformed {
                region: region.name.to_string(),
                message: "the allocation is not a non-negative integer".to_owned(),
            })
    }
}
