//! Which keys differ between two configs (for resuming a run with a changed config).

use std::collections::BTreeMap;

use toml::{Table, Value};

use super::{Config, to_toml};

/// `(dotted key, old value, new value)` for every key whose value differs.
pub fn diff(old: &Config, new: &Config) -> Vec<(String, String, String)> {
    let flat = |c: &Config| {
        let table: Table = to_toml(c).parse().expect("a serialized config parses");
        let mut out = BTreeMap::new();
        flatten(&table, "", &mut out);
        out
    };
    let (a, b) = (flat(old), flat(new));
    a.iter()
        .filter_map(|(k, v)| {
            let w = b.get(k).cloned().unwrap_or_default();
            (*v != w).then(|| (k.clone(), v.clone(), w))
        })
        .collect()
}

fn flatten(table: &Table, prefix: &str, out: &mut BTreeMap<String, String>) {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::Table(t) => flatten(t, &key, out),
            other => {
                out.insert(key, other.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_changed_keys_only() {
        let a = Config::default();
        let mut b = a.clone();
        b.train.epochs = 99;
        b.optim.lr = 0.5;
        let d = diff(&a, &b);
        let keys: Vec<&str> = d.iter().map(|(k, _, _)| k.as_str()).collect();
        assert_eq!(keys, vec!["optim.lr", "train.epochs"]);
        assert_eq!(d[1].2, "99");
    }
}
