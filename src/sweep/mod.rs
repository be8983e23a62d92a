//! `kiln sweep`: many trainings of one base config, placed on GPU slots (see
//! `runner`), ranked by one metric (see `results`).

pub mod asha;
pub mod results;
pub mod runner;
pub mod slurm;
pub mod spec;

pub use spec::{SweepSpec, Trial};
