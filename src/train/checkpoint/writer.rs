//! Puts checkpoints on disk on a thread of their own, so training goes on while a
//! checkpoint is serialised to disk, fsynced, hashed and renamed. The training loop only
//! waits to copy the weights and optimizer state to host memory, and, when the next
//! checkpoint is due before the previous one is on disk, for that one. At most one
//! checkpoint is in flight, so host memory holds at most two.

use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use super::{CheckpointError, Snapshot, Store};

/// What the thread reports for each checkpoint: seconds it took, or why it failed.
type Written = Result<f64, CheckpointError>;

pub struct Writer {
    jobs: Option<Sender<Snapshot>>,
    done: Receiver<Written>,
    handle: Option<JoinHandle<()>>,
    root: std::path::PathBuf,
    in_flight: bool,
    written_s: f64,
}

impl Writer {
    /// Writes into `store`, then keeps `keep_last` checkpoints (and the best, if asked).
    pub fn start(store: Store, keep_last: usize, keep_best: bool) -> Self {
        let (jobs, rx) = channel::<Snapshot>();
        let (tx, done) = channel::<Written>();
        let root = store.root().to_path_buf();
        let handle = std::thread::Builder::new()
            .name("kiln-checkpoint".into())
            .spawn(move || {
                for snap in rx {
                    let t = Instant::now();
                    let r = store
                        .save(snap.step, snap.test_acc, |dir| snap.write(dir))
                        .and_then(|_| store.prune(snap.step, keep_last, keep_best))
                        .map(|()| t.elapsed().as_secs_f64());
                    if tx.send(r).is_err() {
                        return;
                    }
                }
            })
            .expect("spawning the checkpoint thread should succeed");
        Writer {
            jobs: Some(jobs),
            done,
            handle: Some(handle),
            root,
            in_flight: false,
            written_s: 0.0,
        }
    }

    /// Hands `snap` to the thread, once the previous checkpoint is on disk.
    pub fn submit(&mut self, snap: Snapshot) -> Result<(), CheckpointError> {
        self.wait()?;
        let sent = self.jobs.as_ref().map(|j| j.send(snap).is_ok());
        if sent != Some(true) {
            return Err(self.stopped());
        }
        self.in_flight = true;
        Ok(())
    }

    /// Returns once the checkpoint in flight, if any, is on disk (or failed).
    pub fn wait(&mut self) -> Result<(), CheckpointError> {
        if !self.in_flight {
            return Ok(());
        }
        self.in_flight = false;
        match self.done.recv() {
            Ok(r) => self.record(r),
            Err(_) => Err(self.stopped()),
        }
    }

    /// A failure of the checkpoint in flight, if it has failed by now; never waits.
    pub fn poll(&mut self) -> Result<(), CheckpointError> {
        if !self.in_flight {
            return Ok(());
        }
        match self.done.try_recv() {
            Ok(r) => {
                self.in_flight = false;
                self.record(r)
            }
            Err(TryRecvError::Empty) => Ok(()),
            Err(TryRecvError::Disconnected) => {
                self.in_flight = false;
                Err(self.stopped())
            }
        }
    }

    /// Seconds the thread spent on the checkpoints finished so far in this process.
    pub fn written_s(&self) -> f64 {
        self.written_s
    }

    fn record(&mut self, r: Written) -> Result<(), CheckpointError> {
        self.written_s += r?;
        Ok(())
    }

    fn stopped(&self) -> CheckpointError {
        CheckpointError::Record {
            path: self.root.clone(),
            message: "the checkpoint writer thread stopped".into(),
        }
    }
}

impl Drop for Writer {
    /// Every path out of training, errors included, lets the checkpoint in flight reach
    /// the disk: the supervisor restarts from it.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::tempdir;

    fn snap(step: u64) -> Snapshot {
        Snapshot {
            step,
            test_acc: None,
            files: vec![("model.bin", vec![step as u8; 1 << 16])],
        }
    }

    #[test]
    fn checkpoints_reach_the_disk_in_order_and_a_dropped_writer_finishes_its_last() {
        let dir = tempdir();
        let store = Store::new(dir.path());
        let mut w = Writer::start(store.clone(), 2, false);
        for step in 1..=3 {
            w.submit(snap(step)).unwrap();
        }
        w.wait().unwrap();
        assert!(w.written_s() > 0.0);
        let steps = |s: &Store| s.list().into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(steps(&store), [3, 2]);
        w.submit(snap(4)).unwrap();
        drop(w);
        assert_eq!(steps(&store), [4, 3]);
        let (latest, _) = store.latest_valid(|_| {}).unwrap();
        assert!(latest.ends_with("step-000000004"));
    }

    #[test]
    fn a_failed_write_is_reported_and_the_previous_checkpoint_stays() {
        let dir = tempdir();
        let store = Store::new(dir.path());
        let mut w = Writer::start(store.clone(), 2, false);
        w.submit(snap(1)).unwrap();
        w.wait().unwrap();
        // A file where the next temporary directory must go.
        std::fs::write(store.root().join("step-000000002.tmp"), "in the way").unwrap();
        w.submit(snap(2)).unwrap();
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        let e = loop {
            match w.poll() {
                Err(e) => break e,
                Ok(()) if Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                Ok(()) => panic!("the failure was never reported"),
            }
        };
        assert!(e.to_string().contains("step-000000002.tmp"), "{e}");
        let (latest, _) = store.latest_valid(|_| {}).unwrap();
        assert!(latest.ends_with("step-000000001"));
        // Nothing in flight any more: the next checkpoint is taken normally.
        std::fs::remove_file(store.root().join("step-000000002.tmp")).unwrap();
        w.submit(snap(3)).unwrap();
        w.wait().unwrap();
    }
}
