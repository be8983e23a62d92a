//! Which process of a multi-process run this is: rank, world size, local rank and the
//! address of rank 0, as `kiln launch` or Slurm's `srun` put them in the environment.
//! Parsing takes a lookup function, so every form is tested without touching the real
//! environment; [`World::read`] is the one call that reads it.

use serde::Serialize;

/// Set by `kiln launch` for each process it starts.
pub const RANK: &str = "KILN_RANK";
pub const WORLD_SIZE: &str = "KILN_WORLD_SIZE";
pub const LOCAL_RANK: &str = "KILN_LOCAL_RANK";
pub const LOCAL_WORLD_SIZE: &str = "KILN_LOCAL_WORLD_SIZE";
pub const MASTER_ADDR: &str = "KILN_MASTER_ADDR";
/// Also read under Slurm, where the port is otherwise derived from the job and step ids.
pub const MASTER_PORT: &str = "KILN_MASTER_PORT";

/// Who started the processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum WorldSource {
    /// `kiln launch --nproc N` on one machine.
    Launch,
    /// One `srun` step of several tasks.
    Slurm,
}

/// This process's place in a run of several processes (one GPU each).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct World {
    pub rank: usize,
    pub size: usize,
    /// Rank among the processes on this machine; picks the GPU when a process sees all
    /// of the machine's GPUs.
    pub local_rank: usize,
    pub local_size: usize,
    /// Host of rank 0, which every other rank connects to.
    pub master_addr: String,
    pub master_port: u16,
    pub source: WorldSource,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{var}={value:?}: {why}")]
pub struct WorldError {
    pub var: String,
    pub value: String,
    pub why: String,
}

impl World {
    /// The world of this process, from its environment; `None` for a run of one process.
    pub fn read() -> Result<Option<World>, WorldError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<World>, WorldError> {
        if get(RANK).is_some() || get(WORLD_SIZE).is_some() {
            return launched(&get).map(Some);
        }
        // SLURM_STEP_NUM_TASKS is set by srun alone, not in the batch script, so a job
        // script that asked for several tasks is not mistaken for one of them.
        match get("SLURM_STEP_NUM_TASKS") {
            Some(n) if number("SLURM_STEP_NUM_TASKS", Some(n.clone()))? > 1 => {
                slurm(&get).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// `host:port` of rank 0.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    pub fn describe(&self) -> String {
        let by = match self.source {
            WorldSource::Launch => "kiln launch",
            WorldSource::Slurm => "Slurm (srun)",
        };
        format!(
            "rank {} of {} (local rank {} of {}), started by {by}, rank 0 at {}",
            self.rank,
            self.size,
            self.local_rank,
            self.local_size,
            self.master()
        )
    }
}

fn bad(var: &str, value: &str, why: impl Into<String>) -> WorldError {
    WorldError {
        var: var.into(),
        value: value.into(),
        why: why.into(),
    }
}

fn number(var: &str, value: Option<String>) -> Result<usize, WorldError> {
    let value = value.ok_or_else(|| {
        bad(
            var,
            "",
            "not set, but the other variables of a multi-process run are",
        )
    })?;
    value
        .trim()
        .parse()
        .map_err(|_| bad(var, &value, "not a whole number"))
}

fn port(var: &str, value: &str) -> Result<u16, WorldError> {
    match value.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(bad(var, value, "not a TCP port (1-65535)")),
    }
}

fn check(rank: usize, size: usize, rank_var: &str, size_var: &str) -> Result<(), WorldError> {
    if size == 0 {
        return Err(bad(size_var, "0", "a run needs at least one process"));
    }
    if rank >= size {
        return Err(bad(
            rank_var,
            &rank.to_string(),
            format!("ranks go from 0 to {} ({size_var}={size})", size - 1),
        ));
    }
    Ok(())
}

fn launched(get: &impl Fn(&str) -> Option<String>) -> Result<World, WorldError> {
    let rank = number(RANK, get(RANK))?;
    let size = number(WORLD_SIZE, get(WORLD_SIZE))?;
    check(rank, size, RANK, WORLD_SIZE)?;
    let local_rank = get(LOCAL_RANK).map_or(Ok(rank), |v| number(LOCAL_RANK, Some(v)))?;
    let local_size =
        get(LOCAL_WORLD_SIZE).map_or(Ok(size), |v| number(LOCAL_WORLD_SIZE, Some(v)))?;
    check(local_rank, local_size, LOCAL_RANK, LOCAL_WORLD_SIZE)?;
    let master_addr = get(MASTER_ADDR).unwrap_or_else(|| "127.0.0.1".into());
    let master_port = match get(MASTER_PORT) {
        Some(p) => port(MASTER_PORT, &p)?,
        None => return Err(bad(MASTER_PORT, "", "not set; kiln launch sets it")),
    };
    Ok(World {
        rank,
        size,
        local_rank,
        local_size,
        master_addr,
        master_port,
        source: WorldSource::Launch,
    })
}

fn slurm(get: &impl Fn(&str) -> Option<String>) -> Result<World, WorldError> {
    let size = number("SLURM_STEP_NUM_TASKS", get("SLURM_STEP_NUM_TASKS"))?;
    let rank = number("SLURM_PROCID", get("SLURM_PROCID"))?;
    check(rank, size, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")?;
    let local_rank = number("SLURM_LOCALID", get("SLURM_LOCALID"))?;
    let node = get("SLURM_NODEID").map_or(Ok(0), |v| number("SLURM_NODEID", Some(v)))?;
    let per_node = get("SLURM_STEP_TASKS_PER_NODE").unwrap_or_else(|| size.to_string());
    let counts = tasks_per_node(&per_node).ok_or_else(|| {
        bad(
            "SLURM_STEP_TASKS_PER_NODE",
            &per_node,
            "expected a list like 2(x3),1",
        )
    })?;
    let local_size = *counts.get(node).ok_or_else(|| {
        bad(
            "SLURM_NODEID",
            &node.to_string(),
            format!("the step has {} node(s)", counts.len()),
        )
    })?;
    check(
        local_rank,
        local_size,
        "SLURM_LOCALID",
        "SLURM_STEP_TASKS_PER_NODE",
    )?;
    let nodes_var = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .into_iter()
    .find(|v| get(v).is_some())
    .ok_or_else(|| {
        bad(
            "SLURM_STEP_NODELIST",
            "",
            "not set, so rank 0's node is unknown",
        )
    })?;
    let nodes = get(nodes_var).unwrap_or_default();
    let master_addr = first_host(&nodes)
        .ok_or_else(|| bad(nodes_var, &nodes, "no host name in the node list"))?;
    let master_port = match get(MASTER_PORT) {
        Some(p) => port(MASTER_PORT, &p)?,
        None => {
            // Every task of one step derives the same port; other steps and jobs on
            // the node most likely another.
            let job = number("SLURM_JOB_ID", get("SLURM_JOB_ID"))?;
            let step = get("SLURM_STEP_ID")
                .and_then(|s| s.trim().parse::<usize>().ok())
                .unwrap_or(0);
            (20_000 + (job.wrapping_mul(7).wrapping_add(step)) % 20_000) as u16
        }
    };
    Ok(World {
        rank,
        size,
        local_rank,
        local_size,
        master_addr,
        master_port,
        source: WorldSource::Slurm,
    })
}

/// Slurm's compressed task counts, `2(x3),1` → `[2, 2, 2, 1]`.
pub fn tasks_per_node(spec: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        match part.split_once("(x") {
            Some((n, rest)) => {
                let times: usize = rest.strip_suffix(')')?.parse().ok()?;
                let n: usize = n.parse().ok()?;
                out.extend(std::iter::repeat_n(n, times));
            }
            None => out.push(part.parse().ok()?),
        }
    }
    (!out.is_empty()).then_some(out)
}

/// The first host of a Slurm node list: `gpu[07-09,12],cpu1` → `gpu07`.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let mut host = String::new();
    let mut rest = list;
    loop {
        match rest.find(['[', ',']) {
            None => {
                host.push_str(rest);
                break;
            }
            Some(i) if rest.as_bytes()[i] == b',' => {
                host.push_str(&rest[..i]);
                break;
            }
            Some(i) => {
                host.push_str(&rest[..i]);
                let close = rest[i..].find(']')? + i;
                let first = rest[i + 1..close].split([',', '-']).next()?.trim();
                if first.is_empty() {
                    return None;
                }
                host.push_str(first);
                rest = &rest[close + 1..];
            }
        }
    }
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(vars: &[(&str, &str)]) -> Result<Option<World>, WorldError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn no_variables_is_a_run_of_one_process() {
        assert_eq!(world(&[("PATH", "/bin")]).unwrap(), None);
        // A Slurm job or a one-task step (a sweep's array element) is not a world.
        assert_eq!(
            world(&[
                ("SLURM_JOB_ID", "7"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_PROCID", "0")
            ])
            .unwrap(),
            None
        );
        assert_eq!(
            world(&[("SLURM_STEP_NUM_TASKS", "1"), ("SLURM_PROCID", "0")]).unwrap(),
            None
        );
    }

    #[test]
    fn kiln_launch_variables_give_the_rank_and_rank_zeros_address() {
        let w = world(&[
            (RANK, "1"),
            (WORLD_SIZE, "2"),
            (LOCAL_RANK, "1"),
            (LOCAL_WORLD_SIZE, "2"),
            (MASTER_PORT, "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((w.rank, w.size, w.local_rank, w.local_size), (1, 2, 1, 2));
        assert_eq!(w.master(), "127.0.0.1:29500");
        assert_eq!(w.source, WorldSource::Launch);
    }

    #[test]
    fn bad_launch_variables_name_the_variable_and_value() {
        for (vars, var) in [
            (
                vec![(RANK, "2"), (WORLD_SIZE, "2"), (MASTER_PORT, "1")],
                RANK,
            ),
            (
                vec![(RANK, "x"), (WORLD_SIZE, "2"), (MASTER_PORT, "1")],
                RANK,
            ),
            (vec![(RANK, "0"), (MASTER_PORT, "1")], WORLD_SIZE),
            (
                vec![(RANK, "0"), (WORLD_SIZE, "0"), (MASTER_PORT, "1")],
                WORLD_SIZE,
            ),
            (
                vec![(RANK, "0"), (WORLD_SIZE, "2"), (MASTER_PORT, "70000")],
                MASTER_PORT,
            ),
            (vec![(RANK, "0"), (WORLD_SIZE, "2")], MASTER_PORT),
        ] {
            let e = world(&vars).unwrap_err();
            assert_eq!(e.var, var, "{vars:?}: {e}");
        }
    }

    #[test]
    fn an_srun_task_reads_its_rank_node_and_the_first_node_as_rank_zero() {
        let w = world(&[
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_STEP_NODELIST", "gpu[07-08]"),
            ("SLURM_JOB_ID", "1234"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((w.rank, w.size, w.local_rank, w.local_size), (3, 4, 1, 2));
        assert_eq!(w.master_addr, "gpu07");
        assert_eq!(w.source, WorldSource::Slurm);
        // Every task of the step derives the same port.
        assert_eq!(w.master_port, 20_000 + 1234 * 7);
        let e = world(&[
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_ID", "1"),
        ])
        .unwrap_err();
        assert_eq!(e.var, "SLURM_STEP_NODELIST");
    }

    #[test]
    fn slurm_lists_expand_as_slurm_writes_them() {
        assert_eq!(tasks_per_node("2(x3),1"), Some(vec![2, 2, 2, 1]));
        assert_eq!(tasks_per_node("4"), Some(vec![4]));
        assert_eq!(tasks_per_node("2(x"), None);
        for (list, host) in [
            ("node1", "node1"),
            ("gpu[07-09,12],cpu1", "gpu07"),
            ("a[1,3]", "a1"),
            ("rack[1-2]-n[05-06]", "rack1-n05"),
            ("login1,gpu[1-2]", "login1"),
        ] {
            assert_eq!(first_host(list).as_deref(), Some(host), "{list}");
        }
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("gpu[]"), None);
    }
}
