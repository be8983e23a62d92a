//! Reading a config: file → TOML tree → `--set` overrides → unknown-key check →
//! typed [`Config`] → [`Config::validate`]. Precedence is defaults < file < each
//! `--set` in order, last one wins.
//!
//! Unknown keys are found by walking the user's tree against the tree of
//! `Config::default()`, so every error names the dotted key and the nearest valid one.

use std::path::Path;

use toml::{Table, Value};

use super::{Config, ConfigError};

/// Loads `path` and applies `sets` (each `dotted.key=value`).
pub fn load(path: &Path, sets: &[String]) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let table: Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Syntax {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
    resolve(table, &path.display().to_string(), sets)
}

/// Like [`load`], for a config held in memory (`origin` names it in errors).
pub fn load_str(text: &str, origin: &str, sets: &[String]) -> Result<Config, ConfigError> {
    let table: Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Syntax {
            path: origin.into(),
            message: e.to_string().trim_end().to_string(),
        })?;
    resolve(table, origin, sets)
}

/// The config as a TOML document, every key spelled out (what `config.toml` in a run dir holds).
pub fn to_toml(config: &Config) -> String {
    toml::to_string_pretty(config).expect("the config schema should always serialize to TOML")
}

fn resolve(mut table: Table, origin: &str, sets: &[String]) -> Result<Config, ConfigError> {
    let schema = schema_tree();
    check_known(&table, &schema, "", origin)?;
    for arg in sets {
        let (key, mut value) = parse_set(arg)?;
        // A string key takes the text as written: `devices.visible=1` means "1". A list
        // stays a list: `devices.use` is "all", "auto" or [indices].
        if let (Some(Value::String(_)), false) =
            (lookup(&schema, &key), value.is_str() || value.is_array())
        {
            let raw = arg
                .split_once('=')
                .map(|(_, v)| v.trim())
                .unwrap_or_default();
            value = Value::String(raw.to_string());
        }
        check_set_key(&key, &schema, arg)?;
        insert(&mut table, &key, value).map_err(|reason| ConfigError::BadSet {
            arg: arg.clone(),
            reason,
        })?;
    }
    let config: Config =
        serde_path_to_error::deserialize(Value::Table(table.clone())).map_err(|e| {
            let key = e.path().to_string();
            let value = lookup(&table, &key)
                .map(|v| format!(" = {v}"))
                .unwrap_or_default();
            // A bad value may come from the file or from a --set; name the right one.
            // `devices.use[0]`: an element of the key a --set may have set whole.
            let whole = key.split('[').next().unwrap_or(&key);
            let from = sets
                .iter()
                .rev()
                .find(|s| s.split_once('=').is_some_and(|(k, _)| k.trim() == whole))
                .map(|s| format!("--set {s}"))
                .unwrap_or_else(|| origin.to_string());
            ConfigError::Type {
                origin: from,
                key: format!("{key}{value}"),
                message: e.inner().to_string(),
            }
        })?;
    config.validate()?;
    Ok(config)
}

fn schema_tree() -> Table {
    match toml::Table::try_from(Config::default()) {
        Ok(t) => t,
        Err(e) => panic!("the default config should serialize to a TOML table: {e}"),
    }
}

fn check_known(
    user: &Table,
    schema: &Table,
    prefix: &str,
    origin: &str,
) -> Result<(), ConfigError> {
    for (k, v) in user {
        let key = join(prefix, k);
        match schema.get(k) {
            None => {
                return Err(ConfigError::UnknownKey {
                    origin: origin.to_string(),
                    hint: hint(k, schema, prefix),
                    key,
                });
            }
            Some(Value::Table(sub)) => {
                if let Value::Table(user_sub) = v {
                    check_known(user_sub, sub, &key, origin)?;
                }
            }
            Some(_) => {}
        }
    }
    Ok(())
}

fn check_set_key(key: &str, schema: &Table, arg: &str) -> Result<(), ConfigError> {
    let mut node = schema;
    let mut prefix = String::new();
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        match node.get(*part) {
            None => {
                return Err(ConfigError::UnknownKey {
                    origin: format!("--set {arg}"),
                    key: key.to_string(),
                    hint: hint(part, node, &prefix),
                });
            }
            Some(Value::Table(sub)) if i + 1 < parts.len() => node = sub,
            Some(Value::Table(_)) => {
                return Err(ConfigError::BadSet {
                    arg: arg.to_string(),
                    reason: format!(
                        "`{key}` is a section; set one of its keys, e.g. `{key}.{}`",
                        first_key(node, part)
                    ),
                });
            }
            Some(_) if i + 1 < parts.len() => {
                return Err(ConfigError::BadSet {
                    arg: arg.to_string(),
                    reason: format!("`{}` is a value, not a section", join(&prefix, part)),
                });
            }
            Some(_) => {}
        }
        prefix = join(&prefix, part);
    }
    Ok(())
}

fn first_key(node: &Table, section: &str) -> String {
    match node.get(section) {
        Some(Value::Table(t)) => t.keys().next().cloned().unwrap_or_default(),
        _ => String::new(),
    }
}

fn hint(unknown: &str, siblings: &Table, prefix: &str) -> String {
    let key = join(prefix, unknown);
    if let Some((_, new)) = super::MOVED_KEYS.iter().find(|(old, _)| *old == key) {
        return format!("; it moved to another section: write `{new}` instead");
    }
    let best = siblings
        .keys()
        .map(|k| (strsim::jaro_winkler(unknown, k), k))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match best {
        Some((score, k)) if score >= 0.8 => format!("; did you mean `{}`?", join(prefix, k)),
        _ => {
            let keys: Vec<String> = siblings.keys().map(|k| join(prefix, k)).collect();
            format!("; valid keys here: {}", keys.join(", "))
        }
    }
}

fn parse_set(arg: &str) -> Result<(String, Value), ConfigError> {
    let bad = |reason: &str| ConfigError::BadSet {
        arg: arg.to_string(),
        reason: reason.to_string(),
    };
    if arg.contains(['\n', '\r']) {
        return Err(bad(
            "the value holds a line break; a config value is one line (quote a string in TOML if it must hold one)",
        ));
    }
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| bad("expected key=value, e.g. train.epochs=5"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(|p| p.is_empty()) {
        return Err(bad(
            "the key is empty or has an empty part; expected e.g. train.epochs=5",
        ));
    }
    let raw = raw.trim();
    // A value is read as TOML (numbers, booleans, arrays, quoted strings); anything
    // else is taken as a bare string, so `data.dataset=cifar10` needs no quotes.
    let value = format!("v = {raw}")
        .parse::<Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_string()));
    Ok((key.to_string(), value))
}

fn insert(table: &mut Table, key: &str, value: Value) -> Result<(), String> {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().expect("split yields at least one part");
    let mut node = table;
    for part in parts {
        let entry = node
            .entry(part.to_string())
            .or_insert_with(|| Value::Table(Table::new()));
        node = match entry {
            Value::Table(t) => t,
            _ => return Err(format!("`{part}` is a value in the file, not a section")),
        };
    }
    node.insert(last.to_string(), value);
    Ok(())
}

fn lookup<'a>(table: &'a Table, key: &str) -> Option<&'a Value> {
    let mut parts = key.split('.');
    let mut value = table.get(parts.next()?)?;
    for part in parts {
        value = value.as_table()?.get(part)?;
    }
    Some(value)
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, DatasetKind, OptimizerKind};

    fn sets(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(load_str("", "t.toml", &[]).unwrap(), Config::default());
    }

    #[test]
    fn unknown_key_in_file_names_path_and_nearest_key() {
        let err = load_str("[train]\nbatch_szie = 32\n", "t.toml", &[]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("t.toml"), "{msg}");
        assert!(msg.contains("`train.batch_szie`"), "{msg}");
        assert!(msg.contains("did you mean `train.batch_size`"), "{msg}");
    }

    #[test]
    fn unknown_section_lists_valid_sections() {
        let msg = load_str("[xyz]\na = 1\n", "t.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("unknown key `xyz`"), "{msg}");
        assert!(msg.contains("train"), "{msg}");
    }

    #[test]
    fn unknown_set_key_names_the_argument() {
        let msg = load_str("", "t.toml", &sets(&["optim.lrr=0.1"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("--set optim.lrr=0.1"), "{msg}");
        assert!(msg.contains("did you mean `optim.lr`"), "{msg}");
    }

    #[test]
    fn bad_type_names_key_value_and_expectation() {
        let msg = load_str("[train]\nepochs = \"ten\"\n", "t.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("train.epochs = \"ten\""), "{msg}");
        assert!(msg.contains("expected"), "{msg}");
    }

    #[test]
    fn bad_enum_lists_allowed_values() {
        let msg = load_str("", "t.toml", &sets(&["model.arch=resnet19"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("--set model.arch=resnet19"), "{msg}");
        assert!(msg.contains("resnet18"), "{msg}");
    }

    #[test]
    fn convolution_kernels_default_to_auto_and_a_typo_lists_the_choices() {
        use crate::config::Convolution;
        let c = load_str("", "t.toml", &[]).unwrap();
        assert_eq!(c.kernels.convolution, Convolution::Auto);
        let c = load_str("[kernels]\nconvolution = \"burn\"\n", "t.toml", &[]).unwrap();
        assert_eq!(c.kernels.convolution, Convolution::Burn);
        let msg = load_str("", "t.toml", &sets(&["kernels.convolution=cudn"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("cudnn") && msg.contains("burn"), "{msg}");
        use crate::config::BatchNormKernels;
        assert_eq!(c.kernels.batch_norm, BatchNormKernels::Auto);
        let c = load_str("", "t.toml", &sets(&["kernels.batch_norm=burn"])).unwrap();
        assert_eq!(c.kernels.batch_norm, BatchNormKernels::Burn);
        let msg = load_str("", "t.toml", &sets(&["kernels.batch_norm=cudn"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("cudnn") && msg.contains("auto"), "{msg}");
    }

    #[test]
    fn the_convolution_workspace_is_bounded_in_mib() {
        assert_eq!(
            load_str("", "t.toml", &[])
                .unwrap()
                .kernels
                .conv_workspace_mib,
            1024
        );
        let c = load_str("", "t.toml", &sets(&["kernels.conv_workspace_mib=0"])).unwrap();
        assert_eq!(c.kernels.conv_workspace_mib, 0);
        let msg = load_str("", "t.toml", &sets(&["kernels.conv_workspace_mib=5000"]))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("kernels.conv_workspace_mib")
                && msg.contains("5000")
                && msg.contains("4096"),
            "{msg}"
        );
    }

    #[test]
    fn the_memory_pool_is_exact_unless_pages_are_asked_for() {
        use crate::config::MemoryPool;
        let c = load_str("", "t.toml", &[]).unwrap();
        assert_eq!(c.kernels.memory_pool, MemoryPool::Exact);
        let c = load_str("", "t.toml", &sets(&["kernels.memory_pool=pages"])).unwrap();
        assert_eq!(c.kernels.memory_pool, MemoryPool::Pages);
        let msg = load_str("", "t.toml", &sets(&["kernels.memory_pool=paged"]))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("memory_pool") && msg.contains("exact") && msg.contains("pages"),
            "{msg}"
        );
    }

    #[test]
    fn range_error_names_key_value_and_allowed() {
        let msg = load_str(
            "",
            "t.toml",
            &sets(&["train.batch_size=32", "train.grad_accum_steps=5"]),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("train.grad_accum_steps = 5"), "{msg}");
        assert!(msg.contains("divisor of train.batch_size = 32"), "{msg}");
    }

    #[test]
    fn sync_batchnorm_is_rejected_with_the_reason_and_ddp_is_accepted() {
        let msg = load_str("", "t.toml", &sets(&["parallel.sync_batchnorm=true"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("parallel.sync_batchnorm = true"), "{msg}");
        assert!(
            msg.contains("each device normalises its own shard"),
            "{msg}"
        );
        let c = load_str("[parallel]\nstrategy = \"ddp\"\n", "t.toml", &[]).unwrap();
        assert_eq!(c.parallel.strategy, crate::config::DataParallel::Ddp);
    }

    #[test]
    fn performance_flags_that_do_their_job_are_accepted() {
        for ok in [
            "data.pin_memory=true",
            "train.precision=fp32",
            "train.precision=bf16",
            "train.precision=fp16",
        ] {
            assert!(load_str("", "t.toml", &sets(&[ok])).is_ok(), "{ok}");
        }
    }

    #[test]
    fn training_hash_ignores_where_the_run_goes_but_not_what_it_computes() {
        let base = load_str("", "t.toml", &[]).unwrap();
        let moved = load_str(
            "",
            "t.toml",
            &sets(&["devices.use=[1]", "faults.inject=error", "faults.step=3"]),
        )
        .unwrap();
        assert_eq!(base.training_hash(), moved.training_hash());
        assert_eq!(base.training_hash().len(), 64);
        let other = load_str("", "t.toml", &sets(&["optim.lr=0.2"])).unwrap();
        assert_ne!(base.training_hash(), other.training_hash());
    }

    #[test]
    fn set_overrides_file_and_last_set_wins() {
        let c = load_str(
            "[train]\nepochs = 3\n[optim]\nname = \"sgd\"\n",
            "t.toml",
            &sets(&[
                "train.epochs=5",
                "optim.name=adamw",
                "train.epochs=7",
                "data.dataset=cifar10",
            ]),
        )
        .unwrap();
        assert_eq!(c.train.epochs, 7);
        assert_eq!(c.optim.name, OptimizerKind::Adamw);
        assert_eq!(c.data.dataset, DatasetKind::Cifar10);
    }

    #[test]
    fn set_parses_arrays_and_quoted_strings() {
        let c = load_str(
            "",
            "t.toml",
            &sets(&[
                "optim.schedule=step",
                "optim.step_milestones=[2, 4]",
                "data.root=\"a b\"",
            ]),
        )
        .unwrap();
        assert_eq!(c.optim.step_milestones, vec![2, 4]);
        assert_eq!(c.data.root, "a b");
    }

    #[test]
    fn set_of_a_string_key_keeps_the_text_as_written() {
        let c = load_str(
            "",
            "t.toml",
            &sets(&["devices.visible=1", "data.root=2024"]),
        )
        .unwrap();
        assert_eq!(c.devices.visible, "1");
        assert_eq!(c.data.root, "2024");
    }

    #[test]
    fn set_without_equals_or_on_a_section_is_rejected() {
        let msg = load_str("", "t.toml", &sets(&["train.epochs"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("expected key=value"), "{msg}");
        let msg = load_str("", "t.toml", &sets(&["train=3"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("is a section"), "{msg}");
        let msg = load_str("", "t.toml", &sets(&["train.epochs.x=3"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("is a value, not a section"), "{msg}");
    }

    #[test]
    fn a_key_that_moved_section_is_an_error_naming_its_new_place() {
        for (old, new) in crate::config::MOVED_KEYS {
            let (section, key) = old.split_once('.').unwrap();
            let value = Config::default();
            let value = toml::Table::try_from(value).unwrap();
            let (new_section, new_key) = new.split_once('.').unwrap();
            let v = value[new_section].as_table().unwrap()[new_key].clone();
            let file = format!("[{section}]\n{key} = {v}\n");
            let msg = load_str(&file, "t.toml", &[]).unwrap_err().to_string();
            assert!(msg.contains(&format!("`{old}`")), "{msg}");
            assert!(msg.contains(&format!("write `{new}` instead")), "{msg}");
            let msg = load_str("", "t.toml", &sets(&[&format!("{old}={v}")]))
                .unwrap_err()
                .to_string();
            assert!(msg.contains(&format!("--set {old}=")), "{msg}");
            assert!(msg.contains(&format!("write `{new}` instead")), "{msg}");
            assert!(load_str("", "t.toml", &sets(&[&format!("{new}={v}")])).is_ok());
        }
    }

    #[test]
    fn absurd_sizes_are_errors_that_name_the_key_the_value_and_the_limit() {
        for (set, key, limit) in [
            (
                "data.prefetch=1000000000000",
                "data.prefetch",
                "at most 256",
            ),
            (
                "data.num_workers=100000000",
                "data.num_workers",
                "at most 256",
            ),
            (
                "data.synthetic_train_size=1000000000000",
                "data.synthetic_train_size",
                "at most 10000000",
            ),
            (
                "train.batch_size=1000000000",
                "train.batch_size",
                "at most 1048576",
            ),
            ("train.epochs=4000000000", "train.epochs", "at most 100000"),
            (
                "parallel.bucket_mib=100000",
                "parallel.bucket_mib",
                "at most 4096",
            ),
            (
                "checkpoint.keep_last=1000000",
                "checkpoint.keep_last",
                "at most 10000",
            ),
            ("devices.count=5000", "devices.count", "at most 1024"),
        ] {
            let mut s = vec![set.to_string()];
            if set.starts_with("data.synthetic") {
                s.insert(0, "data.dataset=synthetic".into());
            }
            let msg = load_str("", "t.toml", &s).unwrap_err().to_string();
            let value = set.split_once('=').unwrap().1;
            assert!(msg.contains(&format!("{key} = {value}")), "{msg}");
            assert!(msg.contains(limit), "{msg}");
        }
    }

    #[test]
    fn a_set_with_a_line_break_is_refused_not_cut() {
        let msg = load_str("", "t.toml", &sets(&["data.root=a\nb"]))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("line break"), "{msg}");
    }

    #[test]
    fn a_bad_element_of_a_list_set_on_the_command_line_names_the_set() {
        let msg = load_str("", "t.toml", &sets(&["devices.use=[-1]"]))
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("--set devices.use=[-1]"), "{msg}");
    }

    #[test]
    fn syntax_error_names_the_file() {
        let msg = load_str("[train\n", "t.toml", &[]).unwrap_err().to_string();
        assert!(msg.starts_with("t.toml: not valid TOML"), "{msg}");
    }

    #[test]
    fn every_shipped_config_parses() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let is_sweep = path
                .file_stem()
                .is_some_and(|s| s.to_string_lossy().contains("sweep"));
            if path.extension().is_some_and(|e| e == "toml") && !is_sweep {
                load(&path, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                n += 1;
            }
        }
        assert!(
            n >= 3,
            "expected at least resnet, resnet-cifar10 and debug configs"
        );
    }

    #[test]
    fn resolved_config_round_trips() {
        let c = load_str(
            "",
            "t.toml",
            &sets(&["model.arch=resnet50", "train.seed=9"]),
        )
        .unwrap();
        assert_eq!(c.model.arch, Arch::Resnet50);
        let again = load_str(&to_toml(&c), "again.toml", &[]).unwrap();
        assert_eq!(again, c);
    }
}
