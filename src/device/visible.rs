//! `CUDA_VISIBLE_DEVICES` read the way the CUDA driver reads it, so kiln can explain
//! what the driver will show: comma-separated GPU indices, `GPU-` UUIDs (any unique
//! prefix) or `MIG-` instances, in the order given; the driver stops at the first entry
//! it cannot use, and every entry after it is ignored too. A repeated GPU also ends
//! the list. The empty string hides every GPU.

/// One entry of the variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    Index(u32),
    /// A `GPU-…` UUID or a prefix of one, lower case.
    Uuid(String),
    /// A `MIG-…` instance; passed to CUDA as is.
    Mig(String),
}

/// What a physical GPU is known by, for resolving entries.
#[derive(Debug, Clone, PartialEq)]
pub struct Physical {
    pub index: usize,
    pub uuid: String,
}

/// The variable resolved against the machine's GPUs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resolved {
    /// Physical indices, in the order CUDA numbers them (logical 0, 1, ...).
    pub physical: Vec<usize>,
    /// MIG instances named (CUDA shows them; kiln cannot check them).
    pub mig: Vec<String>,
    /// Why the driver stops reading, and what that hides.
    pub warnings: Vec<String>,
}

/// Resolves `raw` against the machine's physical GPUs (from NVML).
pub fn resolve(raw: &str, gpus: &[Physical]) -> Resolved {
    let mut out = Resolved::default();
    if raw.trim().is_empty() {
        return out;
    }
    let tokens: Vec<&str> = raw.split(',').map(str::trim).collect();
    let all: Vec<String> = gpus.iter().map(|g| g.index.to_string()).collect();
    for (i, token) in tokens.iter().enumerate() {
        let problem = match parse(token) {
            None => Some(format!(
                "{token:?} is not a GPU index, a GPU-… UUID or a MIG-… instance"
            )),
            Some(Entry::Mig(m)) => {
                out.mig.push(m);
                None
            }
            Some(Entry::Index(n)) => match gpus.iter().find(|g| g.index == n as usize) {
                None => Some(format!(
                    "GPU {n} does not exist (this machine has GPU{} {})",
                    if all.len() == 1 { "" } else { "s" },
                    if all.is_empty() {
                        "none".into()
                    } else {
                        all.join(", ")
                    }
                )),
                Some(g) => take(&mut out, g.index),
            },
            Some(Entry::Uuid(prefix)) => {
                let hits: Vec<&Physical> = gpus
                    .iter()
                    .filter(|g| g.uuid.to_lowercase().starts_with(&prefix))
                    .collect();
                match hits.as_slice() {
                    [g] => take(&mut out, g.index),
                    [] => Some(format!("no GPU has a UUID starting with {token}")),
                    many => Some(format!(
                        "{token} is the start of {} UUIDs (GPUs {}); give more digits",
                        many.len(),
                        many.iter()
                            .map(|g| g.index.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )),
                }
            }
        };
        if let Some(why) = problem {
            let rest = &tokens[i + 1..];
            let hidden = if rest.is_empty() {
                String::new()
            } else {
                format!(
                    "; the entries after it ({}) are ignored too",
                    rest.join(",")
                )
            };
            out.warnings.push(format!(
                "CUDA_VISIBLE_DEVICES={raw:?}: entry {} {why}. CUDA stops reading there{hidden}, so {}",
                i + 1,
                match out.physical.as_slice() {
                    [] => "no GPU is visible".to_string(),
                    [one] => format!("only GPU {one} is visible"),
                    many => format!(
                        "only GPUs {} are visible",
                        many.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
                    ),
                }
            ));
            break;
        }
    }
    out
}

/// The first entry of `raw` that names a GPU an earlier entry named too (the same
/// index, UUID or MIG instance), which the driver refuses.
pub fn repeated(raw: &str) -> Option<String> {
    let mut seen: Vec<String> = Vec::new();
    for token in raw.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let key = match parse(token)? {
            Entry::Index(n) => format!("GPU {n}"),
            Entry::Uuid(u) => u,
            Entry::Mig(m) => m,
        };
        if seen.contains(&key) {
            return Some(if key.starts_with("GPU ") {
                key
            } else {
                token.to_string()
            });
        }
        seen.push(key);
    }
    None
}

/// Adds `index`, or says why the driver stops at it (a repeat).
fn take(out: &mut Resolved, index: usize) -> Option<String> {
    if out.physical.contains(&index) {
        return Some(format!("repeats GPU {index}"));
    }
    out.physical.push(index);
    None
}

pub fn parse(token: &str) -> Option<Entry> {
    if token.starts_with("GPU-") || token.starts_with("gpu-") {
        return (token.len() > 4).then(|| Entry::Uuid(token.to_lowercase()));
    }
    if token.starts_with("MIG-") {
        return (token.len() > 4).then(|| Entry::Mig(token.to_string()));
    }
    if !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit()) {
        return token.parse().ok().map(Entry::Index);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(n: usize) -> Vec<Physical> {
        (0..n)
            .map(|i| Physical {
                index: i,
                uuid: format!("GPU-{i}{i}aa{i}-0000-1111-2222-33334444555{i}"),
            })
            .collect()
    }

    #[test]
    fn a_repeated_gpu_is_found_whatever_its_spelling() {
        assert_eq!(repeated("0,0").as_deref(), Some("GPU 0"));
        assert_eq!(repeated("1, 0 ,1").as_deref(), Some("GPU 1"));
        assert_eq!(repeated("GPU-abc,GPU-ABC").as_deref(), Some("GPU-ABC"));
        assert_eq!(repeated("0,1,2"), None);
        assert_eq!(repeated(""), None);
    }

    #[test]
    fn follows_the_drivers_rules_on_a_table_of_inputs() {
        let g = gpus(4);
        for (raw, physical, warns) in [
            ("", vec![], false),
            ("0,1", vec![0, 1], false),
            ("1,0", vec![1, 0], false),
            ("2, 3", vec![2, 3], false),
            ("0,2,-1,1", vec![0, 2], true),
            ("5", vec![], true),
            ("1,5,0", vec![1], true),
            ("0,0", vec![0], true),
            ("1,x", vec![1], true),
            ("GPU-22aa2", vec![2], false),
            ("gpu-11AA1", vec![1], false),
            ("GPU-ff", vec![], true),
            ("0,", vec![0], true),
        ] {
            let r = resolve(raw, &g);
            assert_eq!(r.physical, physical, "{raw:?}");
            assert_eq!(!r.warnings.is_empty(), warns, "{raw:?}: {:?}", r.warnings);
        }
    }

    #[test]
    fn warnings_say_what_the_stop_hides() {
        let r = resolve("0,2,-1,1", &gpus(4));
        let w = &r.warnings[0];
        assert!(w.contains("entry 3") && w.contains("\"-1\""), "{w}");
        assert!(w.contains("entries after it (1) are ignored"), "{w}");
        assert!(w.contains("only GPUs 0, 2 are visible"), "{w}");
        let r = resolve("5", &gpus(2));
        assert!(
            r.warnings[0].contains("GPU 5 does not exist (this machine has GPUs 0, 1)"),
            "{}",
            r.warnings[0]
        );
        assert!(r.warnings[0].contains("no GPU is visible"));
    }

    #[test]
    fn ambiguous_uuid_prefix_is_named() {
        let g = vec![
            Physical {
                index: 0,
                uuid: "GPU-abc1".into(),
            },
            Physical {
                index: 1,
                uuid: "GPU-abc2".into(),
            },
        ];
        let r = resolve("GPU-abc", &g);
        assert!(r.physical.is_empty());
        assert!(
            r.warnings[0].contains("start of 2 UUIDs (GPUs 0, 1)"),
            "{}",
            r.warnings[0]
        );
    }

    #[test]
    fn mig_instances_are_kept_for_cuda() {
        let r = resolve("MIG-5c89f9a1-bd8d-5ad6-8b3a-a0d1c1d1e1f1", &gpus(1));
        assert_eq!(r.mig.len(), 1);
        assert!(r.warnings.is_empty());
    }
}
