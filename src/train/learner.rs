//! The learner: the model, its optimizer and the way of training them
//! (`strategy`), held together so that the components around the loop (the
//! checkpointer, the evaluator) ask for what they need and the strategy keeps every
//! replica consistent behind it.

use super::error::TrainError;
use super::optim::Optim;
use super::strategy::{StepInput, StepOutput, TrainingStrategy};
use super::watchdog::Watchdog;
use crate::data::Batch;
use crate::model::ResNet;
use crate::ops::TrainBackend;

pub struct Learner<B: TrainBackend> {
    /// `None` only while a step has it.
    model: Option<ResNet<B>>,
    pub optim: Optim<ResNet<B>, B>,
    strategy: Box<dyn TrainingStrategy<B, ResNet<B>>>,
    /// The step at which BatchNorm's statistics were last made equal everywhere.
    synced_at: Option<u64>,
}

impl<B: TrainBackend> Learner<B> {
    /// Starts the strategy: every replica from the same weights and optimizer state.
    pub fn start(
        model: ResNet<B>,
        optim: Optim<ResNet<B>, B>,
        mut strategy: Box<dyn TrainingStrategy<B, ResNet<B>>>,
    ) -> Result<Self, TrainError> {
        let model = strategy.start(model, &optim)?;
        Ok(Learner {
            model: Some(model),
            optim,
            strategy,
            synced_at: None,
        })
    }

    pub fn model(&self) -> &ResNet<B> {
        self.model
            .as_ref()
            .expect("the model is back after every step")
    }

    pub fn strategy(&mut self) -> &mut dyn TrainingStrategy<B, ResNet<B>> {
        self.strategy.as_mut()
    }

    /// One optimizer step; the output's model is the learner's own (taken back here).
    pub fn step(
        &mut self,
        batch: Batch,
        input: &StepInput,
        watchdog: &Watchdog,
    ) -> Result<StepOutput<()>, TrainError> {
        let model = self
            .model
            .take()
            .expect("the model is back after every step");
        let out = self
            .strategy
            .step(model, &mut self.optim, batch, input, watchdog);
        let out = out?;
        self.model = Some(out.model);
        self.synced_at = None;
        Ok(StepOutput {
            model: (),
            stepped: out.stepped,
            images: out.images,
            stop: out.stop,
        })
    }

    /// Makes BatchNorm's running statistics equal on every replica, once per step:
    /// before evaluating or saving.
    pub fn sync_buffers(&mut self, step: u64) -> Result<(), TrainError> {
        if self.synced_at == Some(step) {
            return Ok(());
        }
        let model = self
            .model
            .take()
            .expect("the model is back after every step");
        let synced = self.strategy.sync_buffers(model, step);
        match synced {
            Ok(m) => {
                self.model = Some(m);
                self.synced_at = Some(step);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}
