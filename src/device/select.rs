//! Choosing GPUs among the visible ones: `use = "all" | [..] | "auto"`, `count`,
//! `min_free_mib`. Pure: takes the visible GPUs (with what NVML knows) and returns the
//! choice with the reason, or an error that shows the numbers.

use super::error::DeviceError;
use super::nvml::{Link, NvmlSnapshot};
use super::probe::GpuInfo;
use crate::config::Selection;

/// Indices into `gpus` (logical CUDA indices), in the order chosen, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub ordinals: Vec<usize>,
    pub reason: String,
}

fn describe(g: &GpuInfo) -> String {
    match &g.physical {
        Some(p) => {
            let procs = if p.processes.is_empty() {
                String::new()
            } else {
                let list: Vec<String> = p
                    .processes
                    .iter()
                    .map(|(pid, name, mib)| format!("{name} (pid {pid}, {mib} MiB)"))
                    .collect();
                format!(", held by {}", list.join(", "))
            };
            format!(
                "cuda:{} ({} MiB free of {}{procs})",
                g.ordinal, p.free_mib, p.total_mib
            )
        }
        None => format!("cuda:{} (free memory unknown: NVML unavailable)", g.ordinal),
    }
}

pub fn choose(
    selection: &Selection,
    count: usize,
    min_free_mib: u64,
    gpus: &[GpuInfo],
    nvml: Option<&NvmlSnapshot>,
    visible_env: Option<&str>,
) -> Result<Choice, DeviceError> {
    let visible_list = || gpus.iter().map(describe).collect::<Vec<_>>().join(", ");
    let enough = |g: &GpuInfo| {
        g.physical
            .as_ref()
            .is_none_or(|p| p.free_mib >= min_free_mib)
    };
    match selection {
        Selection::All => Ok(Choice {
            ordinals: gpus.iter().map(|g| g.ordinal).collect(),
            reason: "devices.use = \"all\"".into(),
        }),
        Selection::List(list) => {
            let mut seen = Vec::new();
            for &id in list {
                if seen.contains(&id) {
                    return Err(DeviceError::Duplicate { id });
                }
                seen.push(id);
                let Some(g) = gpus.iter().find(|g| g.ordinal == id) else {
                    let hint = physical_hint(id, gpus, visible_env);
                    return Err(DeviceError::NotVisible {
                        id,
                        visible: visible_list(),
                        hint,
                    });
                };
                if !enough(g) {
                    return Err(DeviceError::NotEnoughMemory {
                        need_mib: min_free_mib,
                        gpus: describe(g),
                    });
                }
            }
            Ok(Choice {
                ordinals: list.clone(),
                reason: format!("devices.use = {list:?}"),
            })
        }
        Selection::Auto => {
            if gpus.iter().any(|g| g.physical.is_none()) {
                return Err(DeviceError::AutoNeedsNvml);
            }
            let candidates: Vec<&GpuInfo> = gpus.iter().filter(|g| enough(g)).collect();
            if candidates.len() < count {
                return Err(DeviceError::NotEnoughMemory {
                    need_mib: min_free_mib,
                    gpus: format!(
                        "{count} GPU(s) needed, {} qualify: {}",
                        candidates.len(),
                        visible_list()
                    ),
                });
            }
            let best = subsets(candidates.len(), count)
                .into_iter()
                .map(|idx| {
                    let set: Vec<&GpuInfo> = idx.iter().map(|&i| candidates[i]).collect();
                    let link = weakest_link(&set, nvml);
                    let free: u64 = set
                        .iter()
                        .map(|g| g.physical.as_ref().map_or(0, |p| p.free_mib))
                        .sum();
                    (link, free, set)
                })
                // Ties go to the lowest indices, as with CUDA's own order.
                .max_by(|a, b| {
                    let ordinals = |s: &[&GpuInfo]| s.iter().map(|g| g.ordinal).collect::<Vec<_>>();
                    a.0.cmp(&b.0)
                        .then(a.1.cmp(&b.1))
                        .then_with(|| ordinals(&b.2).cmp(&ordinals(&a.2)))
                })
                .expect("count <= candidates, so at least one subset exists");
            let (link, free, set) = best;
            let mut ordinals: Vec<usize> = set.iter().map(|g| g.ordinal).collect();
            ordinals.sort();
            let link_txt = match (count, link) {
                (1, _) => String::new(),
                (_, Some(l)) => format!(", connected by {l:?} at worst"),
                (_, None) => ", connection unknown".into(),
            };
            Ok(Choice {
                reason: format!(
                    "devices.use = \"auto\": {count} of {} GPU(s) with at least {min_free_mib} MiB free, most free memory ({free} MiB together){link_txt}",
                    candidates.len()
                ),
                ordinals,
            })
        }
    }
}

/// The weakest connection within a set (`None`: unknown, or a single GPU).
fn weakest_link(set: &[&GpuInfo], nvml: Option<&NvmlSnapshot>) -> Option<Link> {
    let nvml = nvml?;
    let mut worst: Option<Link> = None;
    for (i, a) in set.iter().enumerate() {
        for b in &set[i + 1..] {
            let l = nvml.link(a.physical.as_ref()?.index, b.physical.as_ref()?.index)?;
            worst = Some(worst.map_or(l, |w| w.min(l)));
        }
    }
    worst
}

/// All `k`-subsets of `0..n`, in lexicographic order (n is at most a few dozen GPUs).
fn subsets(n: usize, k: usize) -> Vec<Vec<usize>> {
    fn go(start: usize, n: usize, k: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if cur.len() == k {
            out.push(cur.clone());
            return;
        }
        for i in start..n {
            cur.push(i);
            go(i + 1, n, k, cur, out);
            cur.pop();
        }
    }
    let mut out = Vec::new();
    go(0, n, k, &mut Vec::new(), &mut out);
    out
}

/// When `id` is not a logical index but is a physical one that is visible under another
/// number, say so: `use` counts after `CUDA_VISIBLE_DEVICES`.
fn physical_hint(id: usize, gpus: &[GpuInfo], visible_env: Option<&str>) -> String {
    let Some(env) = visible_env else {
        return String::new();
    };
    match gpus
        .iter()
        .find(|g| g.physical.as_ref().is_some_and(|p| p.index == id))
    {
        Some(g) => format!(
            "; devices.use counts GPUs after CUDA_VISIBLE_DEVICES={env:?} renumbers them: physical GPU {id} is cuda:{} here",
            g.ordinal
        ),
        None => format!(
            "; devices.use counts GPUs after CUDA_VISIBLE_DEVICES={env:?} renumbers them from 0"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::nvml::PhysicalGpu;

    fn gpu(ordinal: usize, physical: usize, free: u64) -> GpuInfo {
        GpuInfo {
            ordinal,
            name: "NVIDIA H200".into(),
            uuid: format!("GPU-{physical}"),
            pci_bus_id: format!("00000000:0{physical}:00.0"),
            total_mib: 143_771,
            compute_capability: (9, 0),
            physical: Some(PhysicalGpu {
                index: physical,
                uuid: format!("GPU-{physical}"),
                name: "NVIDIA H200".into(),
                pci_bus_id: format!("00000000:0{physical}:00.0"),
                total_mib: 143_771,
                free_mib: free,
                utilization_pct: Some(0),
                compute_mode: "Default".into(),
                processes: if free < 100_000 {
                    vec![(4242, "python3".into(), 143_771 - free)]
                } else {
                    vec![]
                },
            }),
        }
    }

    fn four() -> Vec<GpuInfo> {
        vec![
            gpu(0, 0, 140_000),
            gpu(1, 1, 20_000),
            gpu(2, 2, 139_000),
            gpu(3, 3, 138_000),
        ]
    }

    fn topo() -> NvmlSnapshot {
        // 0-1 and 2-3 by NVLink; across pairs through the host bridge.
        let mut links = vec![(0, 1, Link::NvLinks(18)), (2, 3, Link::NvLinks(18))];
        for (a, b) in [(0, 2), (0, 3), (1, 2), (1, 3)] {
            links.push((a, b, Link::HostBridge));
        }
        NvmlSnapshot {
            gpus: vec![],
            links,
        }
    }

    #[test]
    fn all_and_lists_select_logical_indices() {
        let g = four();
        assert_eq!(
            choose(&Selection::All, 1, 0, &g, None, None)
                .unwrap()
                .ordinals,
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            choose(&Selection::List(vec![2, 0]), 1, 0, &g, None, None)
                .unwrap()
                .ordinals,
            vec![2, 0]
        );
    }

    #[test]
    fn list_mistakes_are_named() {
        let g = four();
        let e = choose(&Selection::List(vec![1, 1]), 1, 0, &g, None, None).unwrap_err();
        assert!(e.to_string().contains("more than once"), "{e}");
        let e = choose(&Selection::List(vec![7]), 1, 0, &g, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cuda:7") || e.contains("7"), "{e}");
        assert!(e.contains("cuda:3 (138000 MiB free"), "{e}");
        let e = choose(&Selection::List(vec![1]), 1, 50_000, &g, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("50000 MiB")
                && e.contains("20000 MiB free")
                && e.contains("python3 (pid 4242"),
            "{e}"
        );
    }

    #[test]
    fn physical_ids_in_use_are_explained() {
        // CUDA_VISIBLE_DEVICES=2,3: logical 0,1 are physical 2,3.
        let g = vec![gpu(0, 2, 139_000), gpu(1, 3, 138_000)];
        let e = choose(&Selection::List(vec![3]), 1, 0, &g, None, Some("2,3"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("physical GPU 3 is cuda:1 here"), "{e}");
    }

    #[test]
    fn auto_takes_the_most_free_memory_and_prefers_nvlinked_sets() {
        let g = four();
        let one = choose(&Selection::Auto, 1, 0, &g, Some(&topo()), None).unwrap();
        assert_eq!(one.ordinals, vec![0]);
        // {0, 2} has the most free memory, but {2, 3} is NVLinked and both have room.
        let two = choose(&Selection::Auto, 2, 100_000, &g, Some(&topo()), None).unwrap();
        assert_eq!(two.ordinals, vec![2, 3]);
        assert!(two.reason.contains("NvLink"), "{}", two.reason);
        let e = choose(&Selection::Auto, 4, 100_000, &g, Some(&topo()), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4 GPU(s) needed, 3 qualify"), "{e}");
    }

    #[test]
    fn auto_breaks_ties_towards_the_lowest_index() {
        // Two idle H200s report the same free memory (seen on the two-GPU machine).
        let g = vec![gpu(0, 1, 143_152), gpu(1, 0, 143_152), gpu(2, 2, 143_152)];
        let one = choose(&Selection::Auto, 1, 0, &g, None, None).unwrap();
        assert_eq!(one.ordinals, vec![0]);
        let two = choose(&Selection::Auto, 2, 0, &g, None, None).unwrap();
        assert_eq!(two.ordinals, vec![0, 1]);
    }

    #[test]
    fn auto_without_nvml_is_refused() {
        let mut g = four();
        g[0].physical = None;
        assert!(matches!(
            choose(&Selection::Auto, 1, 0, &g, None, None),
            Err(DeviceError::AutoNeedsNvml)
        ));
    }

    #[test]
    fn subsets_are_all_combinations() {
        assert_eq!(subsets(4, 2).len(), 6);
        assert_eq!(subsets(3, 3), vec![vec![0, 1, 2]]);
    }
}
