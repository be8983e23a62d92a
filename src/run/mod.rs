//! Running `kiln train` as supervised processes: failure records, the restart policy,
//! and what the exits of a multi-process run's processes mean. No Burn here.

pub mod failure;
pub mod ranks;
pub mod supervisor;
