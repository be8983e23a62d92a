//! The checkpointer: the training loop's one handle on checkpoints. Given only
//! `[checkpoint]` and the run dir, it decides when a checkpoint is due, takes it (the
//! weights with BatchNorm's statistics made equal on every replica first), hands it to
//! the writer thread, and restores the newest good one when a run resumes. A process
//! that does not write (a rank other than 0) takes no checkpoint at all.

use std::path::Path;
use std::time::Instant;

use super::{CheckpointError, Snapshot, Store, Writer, check_compatible, read_state, read_tensors};
use crate::config::CheckpointConfig;
use crate::model::ResNet;
use crate::ops::TrainBackend;
use crate::train::learner::Learner;
use crate::train::optim::Optim;
use crate::train::state::TrainState;

/// A run's state, model and optimizer as a checkpoint held them.
pub type Restored<B> = (TrainState, ResNet<B>, Optim<ResNet<B>, B>);

pub struct Checkpointer {
    every_steps: u64,
    store: Store,
    /// `None`: this process writes nothing.
    writer: Option<Writer>,
    started: Instant,
    /// `elapsed_s` and `checkpoint_write_s` of the state this process started from.
    elapsed_before: f64,
    write_s_before: f64,
}

impl Checkpointer {
    pub fn new(cfg: &CheckpointConfig, run_dir: &Path, writes: bool) -> Self {
        let store = Store::new(run_dir);
        Checkpointer {
            every_steps: cfg.every_steps,
            writer: writes.then(|| Writer::start(store.clone(), cfg.keep_last, cfg.keep_best)),
            store,
            started: Instant::now(),
            elapsed_before: 0.0,
            write_s_before: 0.0,
        }
    }

    /// The run's newest good checkpoint read into `state`, `model` and `optim`, with a
    /// note for every newer one that was skipped (incomplete, truncated, altered, or
    /// unreadable though its manifest matched) and for a training config that changed
    /// since.
    pub fn restore<B: TrainBackend>(
        &mut self,
        state: TrainState,
        mut model: ResNet<B>,
        mut optim: Optim<ResNet<B>, B>,
        device: &B::Device,
        note: &mut dyn FnMut(String),
    ) -> Result<Restored<B>, CheckpointError> {
        let mut skipped = Vec::new();
        for dir in self.store.incomplete() {
            skipped.push(format!(
                "{}: no manifest.json, the checkpoint is incomplete or damaged",
                dir.display()
            ));
        }
        for (_, dir) in self.store.list() {
            let read = self.store.verify(&dir).and_then(|_| read_state(&dir));
            let saved = match read {
                Ok(s) => s,
                Err(e) => {
                    skipped.push(e.to_string());
                    continue;
                }
            };
            // Another network or classes: not damage, a mistake to report.
            check_compatible(&dir, &saved, &state)?;
            // A file can match its manifest and still not be a checkpoint Burn reads
            // (written by another version, or altered together with its manifest).
            let (m, o) = (model.clone(), optim.clone());
            match read_tensors(&dir, m, o, device) {
                Ok(read) => (model, optim) = read,
                Err(e) => {
                    skipped.push(e.to_string());
                    continue;
                }
            }
            for s in &skipped {
                note(format!("kiln: warning: skipping {s}"));
            }
            if !saved.config_sha256.is_empty() && saved.config_sha256 != state.config_sha256 {
                note(
                    "kiln: note: the training config differs from the one that wrote this checkpoint (see the notes above)"
                        .into(),
                );
            }
            let restored = TrainState {
                devices: state.devices.clone(),
                config_sha256: state.config_sha256.clone(),
                ..saved
            };
            self.elapsed_before = restored.elapsed_s;
            self.write_s_before = restored.checkpoint_write_s;
            note(format!(
                "kiln: resuming from {} (epoch {}, batch {}, step {})",
                dir.display(),
                restored.epoch + 1,
                restored.batch_in_epoch,
                restored.step
            ));
            return Ok((restored, model, optim));
        }
        let detail = if skipped.is_empty() {
            String::new()
        } else {
            format!(" (skipped: {})", skipped.join("; "))
        };
        Err(CheckpointError::NoneFound {
            path: self.store.root().to_path_buf(),
            detail,
        })
    }

    /// Whether a checkpoint is due after a step: at every epoch's end, and every
    /// `checkpoint.every_steps` steps within one.
    pub fn is_due(&self, step: u64, end_of_epoch: bool) -> bool {
        end_of_epoch || (self.every_steps > 0 && step.is_multiple_of(self.every_steps))
    }

    /// Saves when [`Self::is_due`]; `test_acc` is the accuracy just measured, if any.
    pub fn maybe_save<B: TrainBackend>(
        &mut self,
        state: &mut TrainState,
        end_of_epoch: bool,
        learner: &mut Learner<B>,
        test_acc: Option<f64>,
    ) -> Result<(), crate::train::TrainError> {
        if self.is_due(state.step, end_of_epoch) {
            self.save_now(state, learner, test_acc)?;
        }
        Ok(())
    }

    /// Copies the checkpoint to host memory and hands it to the writer thread;
    /// `checkpoint_s` counts only the time training waits for that.
    pub fn save_now<B: TrainBackend>(
        &mut self,
        state: &mut TrainState,
        learner: &mut Learner<B>,
        test_acc: Option<f64>,
    ) -> Result<(), crate::train::TrainError> {
        // Every replica takes part in making the statistics equal, writer or not.
        learner.sync_buffers(state.step)?;
        let Some(writer) = self.writer.as_mut() else {
            return Ok(());
        };
        let t = Instant::now();
        state.elapsed_s = self.elapsed_before + self.started.elapsed().as_secs_f64();
        state.checkpoint_write_s = self.write_s_before + writer.written_s();
        let snap = Snapshot::take(learner.model(), &learner.optim, state, test_acc)?;
        writer.submit(snap)?;
        // Counted from the next checkpoint on: this one is already taken.
        state.checkpoint_s += t.elapsed().as_secs_f64();
        state.checkpoints_written += 1;
        crate::detail!(
            "kiln: checkpoint at step {} copied to host memory in {:.2} s; written beside training",
            state.step,
            t.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// A failure of the checkpoint being written, as soon as it is known: training
    /// stops now rather than at the next checkpoint.
    pub fn poll(&mut self) -> Result<(), CheckpointError> {
        match self.writer.as_mut() {
            Some(w) => w.poll(),
            None => Ok(()),
        }
    }

    /// Waits until every checkpoint handed over is on disk; before a run reports its end.
    pub fn flush(&mut self, state: &mut TrainState) -> Result<(), CheckpointError> {
        let Some(writer) = self.writer.as_mut() else {
            return Ok(());
        };
        let t = Instant::now();
        writer.wait()?;
        state.checkpoint_s += t.elapsed().as_secs_f64();
        state.checkpoint_write_s = self.write_s_before + writer.written_s();
        Ok(())
    }

    /// Training wall time over every process of the run so far.
    pub fn elapsed_s(&self) -> f64 {
        self.elapsed_before + self.started.elapsed().as_secs_f64()
    }
}
