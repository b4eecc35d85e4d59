//! tower-admission
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

pub mod clock;
pub mod reject;
