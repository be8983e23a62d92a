//! The run around the trainer, without Burn: the run dir (made, found, resolved,
//! locked against a second writer, its checkpoints on disk), the failure records a
//! training process leaves, the restart policy and the one restart loop that `kiln
//! train`'s supervisor and `kiln launch` share.

pub mod checkpoints;
pub mod failure;
pub mod launch_exits;
pub mod restart;
pub mod run_dir;
pub mod signals;
pub mod supervisor;
