//! `kiln sweep`: many trainings of one base config, placed on GPU slots (see
//! `schedule`), ranked by one metric (see `results`).

pub mod results;
pub mod schedule;
pub mod slurm;
pub mod spec;

pub use spec::{SweepSpec, Trial};
