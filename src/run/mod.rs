//! Running `kiln train` as a supervised process: failure records, and the restart
//! policy. No Burn here.

pub mod failure;
pub mod supervisor;
