//! One process's membership of a multi-process run: the rendezvous with rank 0 and the
//! collectives, as the star the module doc describes.

use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::CollectiveError;
use super::wire::{Elem, Frame, Tag, decode_into, encode, read_frame, write_frame};

const MAGIC: &str = "kiln-dist-1";

/// One process of the run, as the others name it in errors and reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub rank: usize,
    pub host: String,
    pub pid: u32,
    /// The device it trains on, e.g. `cuda:0 NVIDIA H200`.
    pub device: String,
}

#[derive(Serialize, Deserialize)]
struct Hello {
    magic: String,
    size: usize,
    training_hash: String,
    run_dir: Option<String>,
    member: Member,
}

#[derive(Serialize, Deserialize)]
struct Welcome {
    run_dir: String,
    members: Vec<Member>,
}

/// What a process brings to the rendezvous.
pub struct Join<'a> {
    pub rank: usize,
    pub size: usize,
    /// `host:port` of rank 0; rank 0 listens on that port on every address.
    pub master: &'a str,
    pub port: u16,
    /// How long to wait for the others to turn up.
    pub timeout: Duration,
    /// Every rank must train the same config (`Config::training_hash`).
    pub training_hash: &'a str,
    /// Rank 0's run dir; another rank's, if it was given one, must be the same.
    pub run_dir: Option<&'a Path>,
    pub device: &'a str,
}

struct Link {
    rank: usize,
    stream: TcpStream,
}

/// This process's place in the run and its sockets: to every other rank on rank 0, to
/// rank 0 on the others.
pub struct Group {
    rank: usize,
    size: usize,
    links: Vec<Link>,
    members: Vec<Member>,
    run_dir: PathBuf,
    timeout: Duration,
    seq: u64,
    scratch: Vec<u8>,
}

fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

fn comparable(dir: &Path) -> String {
    dir.canonicalize()
        .unwrap_or_else(|_| dir.to_path_buf())
        .display()
        .to_string()
}

impl Group {
    /// Meets the other ranks: rank 0 waits for all of them, checks them and welcomes
    /// them; every other rank connects to rank 0 (retrying while it starts).
    pub fn join(j: &Join) -> Result<Group, CollectiveError> {
        let me = Member {
            rank: j.rank,
            host: this_host(),
            pid: std::process::id(),
            device: j.device.to_string(),
        };
        let mut g = if j.rank == 0 {
            Self::welcome(j, me)?
        } else {
            Self::enter(j, me)?
        };
        g.set_timeout(j.timeout);
        Ok(g)
    }

    fn welcome(j: &Join, me: Member) -> Result<Group, CollectiveError> {
        let run_dir = j
            .run_dir
            .expect("rank 0 makes the run dir before the rendezvous")
            .to_path_buf();
        let listener =
            TcpListener::bind(("0.0.0.0", j.port)).map_err(|source| CollectiveError::Bind {
                port: j.port,
                source,
            })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| CollectiveError::Bind {
                port: j.port,
                source,
            })?;
        let deadline = Instant::now() + j.timeout;
        let mut joined: Vec<Option<(TcpStream, Member)>> = (0..j.size).map(|_| None).collect();
        let mut problem: Option<String> = None;
        let mut strays: Vec<TcpStream> = Vec::new();
        while joined.iter().skip(1).any(Option::is_none) && problem.is_none() {
            if Instant::now() > deadline {
                return Err(CollectiveError::Incomplete {
                    port: j.port,
                    missing: (1..j.size).filter(|&r| joined[r].is_none()).collect(),
                    waited: j.timeout,
                });
            }
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                }
                Err(_) => continue,
            };
            // A connection that is not a kiln rank (a port scan, a stray client) is
            // dropped; only a rank's hello counts.
            let Some((stream, hello)) = read_hello(stream) else {
                continue;
            };
            let r = hello.member.rank;
            let mine = comparable(&run_dir);
            problem = if hello.size != j.size {
                Some(format!(
                    "rank {r} was started for {} processes, rank 0 for {}",
                    hello.size, j.size
                ))
            } else if r == 0 || r >= j.size {
                Some(format!("a process says it is rank {r} of {}", j.size))
            } else if joined[r].is_some() {
                Some(format!("two processes say they are rank {r}"))
            } else if hello.training_hash != j.training_hash {
                Some(format!(
                    "rank {r} ({}) trains another config than rank 0 (training config hash {} against {})",
                    hello.member.host,
                    short(&hello.training_hash),
                    short(j.training_hash)
                ))
            } else if hello.run_dir.as_ref().is_some_and(|d| *d != mine) {
                Some(format!(
                    "rank {r} was given the run dir {}, rank 0 {mine}",
                    hello.run_dir.clone().unwrap_or_default()
                ))
            } else {
                None
            };
            match problem {
                None => joined[r] = Some((stream, hello.member)),
                Some(_) => strays.push(stream),
            }
        }
        let mut members = vec![me];
        let mut links = Vec::new();
        for (stream, member) in joined.into_iter().skip(1).flatten() {
            members.push(member.clone());
            links.push(Link {
                rank: member.rank,
                stream,
            });
        }
        if let Some(why) = problem {
            for s in links.iter_mut().map(|l| &mut l.stream).chain(&mut strays) {
                let _ = write_frame(s, Tag::Reject, 0, 0, why.as_bytes());
            }
            return Err(CollectiveError::Mismatch(why));
        }
        let welcome = serde_json::to_vec(&Welcome {
            run_dir: run_dir.display().to_string(),
            members: members.clone(),
        })
        .expect("plain data serializes");
        for l in &mut links {
            write_frame(&mut l.stream, Tag::Welcome, 0, 0, &welcome).map_err(|e| {
                CollectiveError::Lost {
                    rank: l.rank,
                    who: String::new(),
                    during: "the rendezvous".into(),
                    why: e.to_string(),
                }
            })?;
        }
        Ok(Group {
            rank: 0,
            size: j.size,
            links,
            members,
            run_dir,
            timeout: j.timeout,
            seq: 0,
            scratch: Vec::new(),
        })
    }

    fn enter(j: &Join, me: Member) -> Result<Group, CollectiveError> {
        let deadline = Instant::now() + j.timeout;
        let unreachable = |last: String| CollectiveError::Unreachable {
            rank: j.rank,
            addr: j.master.to_string(),
            waited: j.timeout,
            last,
        };
        let mut stream = loop {
            // Every address the name has (`localhost` is ::1 and 127.0.0.1; rank 0
            // listens on IPv4).
            let attempt = j.master.to_socket_addrs().and_then(|addrs| {
                let mut last = std::io::Error::new(ErrorKind::NotFound, "no address");
                for addr in addrs {
                    match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            });
            match attempt {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => return Err(unreachable(e.to_string())),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        };
        let _ = stream.set_nodelay(true);
        let hello = serde_json::to_vec(&Hello {
            magic: MAGIC.into(),
            size: j.size,
            training_hash: j.training_hash.to_string(),
            run_dir: j.run_dir.map(comparable),
            member: me,
        })
        .expect("plain data serializes");
        let lost = |why: String| CollectiveError::Lost {
            rank: 0,
            who: String::new(),
            during: "the rendezvous".into(),
            why,
        };
        write_frame(&mut stream, Tag::Hello, 0, 0, &hello).map_err(|e| lost(e.to_string()))?;
        // Rank 0 answers once every rank has joined.
        let _ = stream.set_read_timeout(Some(j.timeout));
        let frame = read_frame(&mut stream, Vec::new()).map_err(|e| lost(io_why(&e)))?;
        match frame.tag {
            Tag::Welcome => {
                let w: Welcome = serde_json::from_slice(&frame.payload)
                    .map_err(|e| lost(format!("unreadable welcome: {e}")))?;
                Ok(Group {
                    rank: j.rank,
                    size: j.size,
                    links: vec![Link { rank: 0, stream }],
                    members: w.members,
                    run_dir: PathBuf::from(w.run_dir),
                    timeout: j.timeout,
                    seq: 0,
                    scratch: Vec::new(),
                })
            }
            Tag::Reject => Err(CollectiveError::Mismatch(
                String::from_utf8_lossy(&frame.payload).into_owned(),
            )),
            _ => Err(lost("unexpected answer to its hello".into())),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn is_root(&self) -> bool {
        self.rank == 0
    }

    /// Every process, by rank.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The run dir rank 0 chose.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// How long a collective waits for a peer before calling it hung.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        for l in &self.links {
            let _ = l.stream.set_read_timeout(Some(timeout));
            let _ = l.stream.set_write_timeout(Some(timeout));
        }
    }

    /// Sums `bufs` over every rank, in rank order, into every rank's `bufs`; ORs the
    /// `flags` words and returns the result. `during` names the step for errors.
    pub fn sum_f32(
        &mut self,
        bufs: &mut [&mut [f32]],
        flags: u32,
        during: &str,
    ) -> Result<u32, CollectiveError> {
        self.collective(bufs, flags, during, true)
    }

    pub fn sum_f64(&mut self, bufs: &mut [f64], during: &str) -> Result<(), CollectiveError> {
        self.collective(&mut [bufs], 0, during, true).map(|_| ())
    }

    /// Rank 0's `bufs` into every rank's.
    pub fn broadcast_f32(
        &mut self,
        bufs: &mut [&mut [f32]],
        during: &str,
    ) -> Result<(), CollectiveError> {
        self.collective(bufs, 0, during, false).map(|_| ())
    }

    /// Rank 0's bytes into every rank's (an NCCL group id, say).
    pub fn broadcast_bytes(&mut self, buf: &mut [u8], during: &str) -> Result<(), CollectiveError> {
        self.collective(&mut [buf], 0, during, false).map(|_| ())
    }

    fn who(&self, rank: usize) -> String {
        self.members
            .iter()
            .find(|m| m.rank == rank)
            .map(|m| format!(" ({}, pid {}, {})", m.host, m.pid, m.device))
            .unwrap_or_default()
    }

    fn io_error(&self, rank: usize, during: &str, e: &std::io::Error) -> CollectiveError {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => CollectiveError::Timeout {
                rank,
                who: self.who(rank),
                during: during.into(),
                waited: self.timeout,
            },
            _ => CollectiveError::Lost {
                rank,
                who: self.who(rank),
                during: during.into(),
                why: io_why(e),
            },
        }
    }

    fn collective<E: Elem>(
        &mut self,
        bufs: &mut [&mut [E]],
        flags: u32,
        during: &str,
        sum: bool,
    ) -> Result<u32, CollectiveError> {
        if self.size == 1 {
            return Ok(flags);
        }
        self.seq += 1;
        let bytes: usize = bufs.iter().map(|b| b.len() * E::SIZE).sum();
        let result = if self.is_root() {
            self.gather_and_answer(bufs, flags, during, sum, bytes)
        } else {
            self.contribute(bufs, flags, during, sum, bytes)
        };
        if let (Err(e), true) = (&result, self.is_root()) {
            // Tell the ranks still there why the run ends, so they do not wait for a
            // result that never comes.
            let why = e.to_string();
            for l in &mut self.links {
                let _ = write_frame(&mut l.stream, Tag::Abort, self.seq, 0, why.as_bytes());
            }
        }
        result
    }

    fn gather_and_answer<E: Elem>(
        &mut self,
        bufs: &mut [&mut [E]],
        mut flags: u32,
        during: &str,
        sum: bool,
        bytes: usize,
    ) -> Result<u32, CollectiveError> {
        if sum {
            for i in 0..self.links.len() {
                let scratch = std::mem::take(&mut self.scratch);
                let rank = self.links[i].rank;
                let frame = read_frame(&mut self.links[i].stream, scratch)
                    .map_err(|e| self.io_error(rank, during, &e))?;
                self.check(&frame, rank, bytes, during)?;
                decode_into(&frame.payload, bufs, true);
                flags |= frame.flags;
                self.scratch = frame.payload;
            }
        }
        let mut out = std::mem::take(&mut self.scratch);
        encode(bufs, &mut out);
        let tag = Tag::Result;
        let mut failed = None;
        for l in &mut self.links {
            if let Err(e) = write_frame(&mut l.stream, tag, self.seq, flags, &out) {
                failed = Some((l.rank, e));
                break;
            }
        }
        self.scratch = out;
        match failed {
            Some((rank, e)) => Err(self.io_error(rank, during, &e)),
            None => Ok(flags),
        }
    }

    fn contribute<E: Elem>(
        &mut self,
        bufs: &mut [&mut [E]],
        flags: u32,
        during: &str,
        sum: bool,
        bytes: usize,
    ) -> Result<u32, CollectiveError> {
        let mut out = std::mem::take(&mut self.scratch);
        if sum {
            encode(bufs, &mut out);
            write_frame(
                &mut self.links[0].stream,
                Tag::Contribute,
                self.seq,
                flags,
                &out,
            )
            .map_err(|e| self.io_error(0, during, &e))?;
        }
        let frame =
            read_frame(&mut self.links[0].stream, out).map_err(|e| self.io_error(0, during, &e))?;
        if frame.tag == Tag::Abort {
            return Err(CollectiveError::Aborted(
                String::from_utf8_lossy(&frame.payload).into_owned(),
            ));
        }
        self.check(&frame, 0, bytes, during)?;
        decode_into(&frame.payload, bufs, false);
        let flags = frame.flags;
        self.scratch = frame.payload;
        Ok(flags)
    }

    fn check(
        &self,
        frame: &Frame,
        rank: usize,
        bytes: usize,
        during: &str,
    ) -> Result<(), CollectiveError> {
        let expected = if self.is_root() {
            Tag::Contribute
        } else {
            Tag::Result
        };
        if frame.tag != expected || frame.seq != self.seq || frame.payload.len() != bytes {
            return Err(CollectiveError::Mismatch(format!(
                "during {during}, rank {rank} sent collective {} of {} bytes where collective {} of {bytes} bytes was due (different models or schedules?)",
                frame.seq,
                frame.payload.len(),
                self.seq
            )));
        }
        Ok(())
    }
}

fn read_hello(mut stream: TcpStream) -> Option<(TcpStream, Hello)> {
    stream.set_nonblocking(false).ok()?;
    let _ = stream.set_nodelay(true);
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let frame = read_frame(&mut stream, Vec::new()).ok()?;
    let hello: Hello = (frame.tag == Tag::Hello)
        .then(|| serde_json::from_slice(&frame.payload).ok())
        .flatten()?;
    (hello.magic == MAGIC).then_some((stream, hello))
}

fn io_why(e: &std::io::Error) -> String {
    match e.kind() {
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::BrokenPipe => {
            "its connection closed (the process ended)".into()
        }
        _ => e.to_string(),
    }
}

fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// `size` ranks as threads on loopback, each running `body` on its group.
    fn ranks<T: Send + 'static>(
        size: usize,
        hash: impl Fn(usize) -> String,
        body: impl Fn(Group) -> T + Send + Sync + 'static,
    ) -> Vec<Result<T, CollectiveError>> {
        let port = free_port();
        let dir = crate::test_util::tempdir();
        let root_dir = dir.path().to_path_buf();
        let body = std::sync::Arc::new(body);
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (body, hash, root_dir) = (body.clone(), hash(rank), root_dir.clone());
                std::thread::spawn(move || {
                    let master = format!("127.0.0.1:{port}");
                    let g = Group::join(&Join {
                        rank,
                        size,
                        master: &master,
                        port,
                        timeout: Duration::from_secs(20),
                        training_hash: &hash,
                        run_dir: (rank == 0).then_some(root_dir.as_path()),
                        device: "cpu",
                    })?;
                    Ok(body(g))
                })
            })
            .collect();
        let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
        drop(dir);
        out
    }

    #[test]
    fn sums_reach_every_rank_in_rank_order_with_the_flags_ored() {
        let out = ranks(
            3,
            |_| "same".into(),
            |mut g| {
                let r = g.rank() as f32;
                let (mut a, mut b) = (vec![r, 1.0], vec![10.0 * r]);
                let flags = g
                    .sum_f32(
                        &mut [a.as_mut_slice(), b.as_mut_slice()],
                        1 << g.rank(),
                        "step 1",
                    )
                    .unwrap();
                let mut m = [g.rank() as f64, 2.0];
                g.sum_f64(&mut m, "eval").unwrap();
                let mut w = vec![g.rank() as f32 + 5.0];
                g.broadcast_f32(&mut [w.as_mut_slice()], "start").unwrap();
                (
                    a,
                    b,
                    flags,
                    m,
                    w,
                    g.run_dir().to_path_buf(),
                    g.members().len(),
                )
            },
        );
        let first = out[0].as_ref().unwrap();
        for o in &out {
            let (a, b, flags, m, w, dir, n) = o.as_ref().unwrap();
            assert_eq!((a.as_slice(), b.as_slice()), (&[3.0, 3.0][..], &[30.0][..]));
            assert_eq!(
                (*flags, *m, w.as_slice(), *n),
                (0b111, [3.0, 6.0], &[5.0][..], 3)
            );
            assert_eq!(dir, &first.5, "every rank learns rank 0's run dir");
        }
    }

    #[test]
    fn a_rank_with_another_config_is_refused_at_the_rendezvous() {
        let out = ranks(
            2,
            |r| if r == 0 { "aaa".into() } else { "bbb".into() },
            |_| (),
        );
        for o in out {
            let e = o.unwrap_err().to_string();
            assert!(e.contains("trains another config"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_leaves_ends_the_collective_everywhere_naming_it() {
        let out = ranks(
            3,
            |_| "same".into(),
            |mut g| {
                let mut v = vec![1.0f32];
                g.sum_f32(&mut [v.as_mut_slice()], 0, "step 1").unwrap();
                if g.rank() == 2 {
                    return String::new(); // leaves: its socket closes with the group
                }
                g.sum_f32(&mut [v.as_mut_slice()], 0, "step 2")
                    .unwrap_err()
                    .to_string()
            },
        );
        let root = out[0].as_ref().unwrap();
        assert!(
            root.contains("rank 2") && root.contains("step 2") && root.contains("closed"),
            "{root}"
        );
        let other = out[1].as_ref().unwrap();
        assert!(
            other.contains("rank 0 ended the run") && other.contains("rank 2"),
            "{other}"
        );
    }

    #[test]
    fn a_silent_rank_is_a_timeout_not_a_hang() {
        let out = ranks(
            2,
            |_| "same".into(),
            |mut g| {
                g.set_timeout(Duration::from_millis(300));
                if g.rank() == 1 {
                    std::thread::sleep(Duration::from_millis(900));
                    return String::new();
                }
                let mut v = vec![1.0f32];
                g.sum_f32(&mut [v.as_mut_slice()], 0, "step 9")
                    .unwrap_err()
                    .to_string()
            },
        );
        let e = out[0].as_ref().unwrap();
        assert!(
            e.contains("no word from rank 1") && e.contains("step 9"),
            "{e}"
        );
    }

    #[test]
    fn a_rank_without_rank_zero_gives_up_naming_the_address() {
        let port = free_port();
        let master = format!("127.0.0.1:{port}");
        let e = Group::join(&Join {
            rank: 1,
            size: 2,
            master: &master,
            port,
            timeout: Duration::from_millis(500),
            training_hash: "h",
            run_dir: None,
            device: "cpu",
        })
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("could not reach rank 0") && e.contains(&master),
            "{e}"
        );
    }
}
