//! The exchange of threads of one process through host memory: each replica reads its
//! buffers back, puts them on a shared board and waits; the last to arrive adds them
//! in replica order (float addition is not associative: the same order gives the same
//! numbers every run) and every replica uploads the result. What the CPU backend uses;
//! on GPUs NCCL replaces it.

use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::{Aborter, Exchange, ExchangeError};

/// Buffers in host memory.
type Host = Vec<Vec<f32>>;

#[derive(Default)]
struct Round {
    /// Each replica's buffers, once it has put them down.
    put: Vec<Option<Host>>,
    /// The result, once everyone has put theirs down.
    result: Option<Arc<Host>>,
    /// Replicas that have not taken the result yet.
    to_take: usize,
    /// Why this round will never complete.
    aborted: Option<String>,
}

/// The board the replicas of one process meet at.
pub struct HostBoard {
    size: usize,
    round: Mutex<Round>,
    changed: Condvar,
}

impl HostBoard {
    pub fn new(size: usize) -> Arc<Self> {
        Arc::new(HostBoard {
            size,
            round: Mutex::new(Round {
                put: vec![None; size],
                ..Round::default()
            }),
            changed: Condvar::new(),
        })
    }

    /// Replica `rank`'s end of the board.
    pub fn exchange(self: &Arc<Self>, rank: usize) -> HostExchange {
        HostExchange {
            board: self.clone(),
            rank,
        }
    }

    /// Wakes every replica waiting on the board with an error.
    pub fn abort(&self, why: &str) {
        let mut r = self.round.lock().unwrap_or_else(|e| e.into_inner());
        r.aborted.get_or_insert_with(|| why.to_string());
        self.changed.notify_all();
    }

    /// Clears an aborted round, once no replica is inside it any more (after a failed
    /// step every replica has answered).
    pub fn reset(&self) {
        let mut r = self.round.lock().unwrap_or_else(|e| e.into_inner());
        *r = Round {
            put: vec![None; self.size],
            ..Round::default()
        };
    }

    /// Puts `mine` down for replica `rank` and returns what `combine` makes of
    /// everyone's, once all have put theirs down.
    fn meet(
        &self,
        rank: usize,
        mine: Host,
        combine: impl FnOnce(Vec<Host>) -> Result<Host, String>,
    ) -> Result<Arc<Host>, ExchangeError> {
        let mut r = self.round.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &r.aborted {
            return Err(ExchangeError::Aborted(why.clone()));
        }
        r.put[rank] = Some(mine);
        if r.put.iter().all(Option::is_some) {
            let all: Vec<Host> = r
                .put
                .iter_mut()
                .map(|p| p.take().expect("all put"))
                .collect();
            match combine(all) {
                Ok(result) => {
                    r.result = Some(Arc::new(result));
                    r.to_take = self.size;
                }
                Err(why) => r.aborted = Some(why),
            }
            self.changed.notify_all();
        }
        loop {
            if let Some(why) = &r.aborted {
                return Err(ExchangeError::Aborted(why.clone()));
            }
            if let Some(result) = r.result.clone() {
                r.to_take -= 1;
                if r.to_take == 0 {
                    r.result = None;
                }
                // A replica taking the result of this round may not start the next
                // one until every replica has taken it.
                self.changed.notify_all();
                while r.result.is_some() && r.aborted.is_none() {
                    r = self.changed.wait(r).unwrap_or_else(|e| e.into_inner());
                }
                return Ok(result);
            }
            r = self.changed.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The element-wise sum of every replica's buffers, in replica order; an error when
/// their lengths differ.
pub fn sum_in_order(parts: Vec<Host>) -> Result<Host, String> {
    let mut parts = parts.into_iter();
    let mut sum = parts.next().unwrap_or_default();
    for (rank, part) in parts.enumerate() {
        if part.len() != sum.len() || part.iter().zip(&sum).any(|(a, b)| a.len() != b.len()) {
            return Err(format!(
                "replica {} exchanges buffers of other lengths than replica 0",
                rank + 1
            ));
        }
        for (s, p) in sum.iter_mut().zip(&part) {
            s.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
    }
    Ok(sum)
}

/// One replica's end of a [`HostBoard`].
pub struct HostExchange {
    board: Arc<HostBoard>,
    rank: usize,
}

/// `buffers` read back to host memory as f32.
pub fn to_host<B: Backend>(buffers: Vec<Tensor<B, 1>>) -> Host {
    buffers
        .into_iter()
        .map(|t| {
            t.into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("float buffers read back as f32")
        })
        .collect()
}

/// Host buffers uploaded to `device`, as f32: a bf16 exchange is summed in f32 here
/// and stays so.
pub fn from_host<B: Backend>(host: &Host, device: &B::Device) -> Vec<Tensor<B, 1>> {
    host.iter()
        .map(|v| Tensor::<B, 1>::from_data(TensorData::new(v.clone(), [v.len()]), device))
        .collect()
}

impl<B: Backend> Exchange<B> for HostExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.board.size
    }

    fn all_reduce(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        _during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        let Some(device) = buffers.first().map(|t| t.device()) else {
            return Ok(buffers);
        };
        let sum = self.board.meet(self.rank, to_host(buffers), sum_in_order)?;
        Ok(from_host::<B>(&sum, &device))
    }

    fn broadcast(
        &mut self,
        buffers: Vec<Tensor<B, 1>>,
        _during: &str,
    ) -> Result<Vec<Tensor<B, 1>>, ExchangeError> {
        let Some(device) = buffers.first().map(|t| t.device()) else {
            return Ok(buffers);
        };
        // Only replica 0's buffers matter; the others put down nothing to read.
        let mine = if self.rank == 0 {
            to_host(buffers)
        } else {
            Vec::new()
        };
        let root = self
            .board
            .meet(self.rank, mine, |mut all| Ok(all.swap_remove(0)))?;
        Ok(from_host::<B>(&root, &device))
    }

    fn aborter(&self) -> Aborter {
        let board = self.board.clone();
        Aborter::new(move |why| board.abort(why))
    }

    fn engine(&self) -> String {
        "host memory".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_meet_add_in_order_and_meet_again() {
        let board = HostBoard::new(3);
        let results: Vec<Vec<Arc<Host>>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..3)
                .map(|rank| {
                    let board = board.clone();
                    s.spawn(move || {
                        (0..4)
                            .map(|round| {
                                let mine = vec![vec![rank as f32 + round as f32; 5], vec![1.0]];
                                board.meet(rank, mine, sum_in_order).unwrap()
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for per_rank in &results {
            for (round, r) in per_rank.iter().enumerate() {
                // Ranks 0, 1 and 2 each put down rank + round.
                let expected = 3.0 + 3.0 * round as f32;
                assert_eq!(**r, vec![vec![expected; 5], vec![3.0]]);
            }
        }
    }

    #[test]
    fn an_aborted_board_releases_the_waiting_replicas_and_resets() {
        let board = HostBoard::new(2);
        let waiting = {
            let board = board.clone();
            std::thread::spawn(move || board.meet(0, vec![vec![1.0]], sum_in_order))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        board.abort("replica 1 failed");
        let err = waiting.join().unwrap().unwrap_err();
        assert!(matches!(err, ExchangeError::Aborted(ref w) if w.contains("replica 1")));
        board.reset();
        let other = {
            let board = board.clone();
            std::thread::spawn(move || board.meet(1, vec![vec![2.0]], sum_in_order))
        };
        let mine = board.meet(0, vec![vec![1.0]], sum_in_order).unwrap();
        assert_eq!(*mine, vec![vec![3.0]]);
        assert_eq!(*other.join().unwrap().unwrap(), vec![vec![3.0]]);
    }

    #[test]
    fn large_buffers_add_in_replica_order() {
        let n = 600_001;
        let part = |k: f32| {
            vec![
                (0..n).map(|i| k * i as f32 + 0.1).collect::<Vec<f32>>(),
                vec![k; 3],
            ]
        };
        let sum = sum_in_order(vec![part(1.0), part(0.5), part(-0.25)]).unwrap();
        for i in [0, 1, 262_143, 262_144, 524_288, n - 1] {
            let x = i as f32;
            let expected = (1.0 * x + 0.1) + (0.5 * x + 0.1) + (-0.25 * x + 0.1);
            assert_eq!(sum[0][i], expected, "element {i}");
        }
        assert_eq!(sum[1], vec![1.25f32; 3]);
    }

    #[test]
    fn buffers_of_other_lengths_are_an_error_not_a_wrong_sum() {
        let e = sum_in_order(vec![vec![vec![1.0, 2.0]], vec![vec![1.0]]]).unwrap_err();
        assert!(e.contains("replica 1"), "{e}");
    }
}
