//! The balance between the devices of a data-parallel run: one line per device for the
//! epoch report, and a warning naming a device that is much slower than the others.

/// One device's timed work over a reporting window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceLoad {
    pub name: String,
    /// Images it was given.
    pub images: usize,
    /// Steps that were timed.
    pub steps: usize,
    /// Its forward and backward passes over the timed steps.
    pub busy_s: f64,
}

/// One line per device, and a warning when step times differ by more than 15%,
/// naming the slow device.
pub fn balance_report(load: &[DeviceLoad]) -> (String, Option<String>) {
    let per_step = |l: &DeviceLoad| {
        if l.steps == 0 {
            0.0
        } else {
            l.busy_s * 1e3 / l.steps as f64
        }
    };
    let line = load
        .iter()
        .map(|l| {
            format!(
                "{} {} img/step {:.1} ms",
                l.name,
                l.images.checked_div(l.steps).unwrap_or(0),
                per_step(l)
            )
        })
        .collect::<Vec<_>>()
        .join(" | ");
    let times: Vec<f64> = load.iter().map(per_step).collect();
    let fast = times.iter().cloned().fold(f64::INFINITY, f64::min);
    let (slow_i, slow) =
        times.iter().enumerate().fold(
            (0, 0.0),
            |acc, (i, &t)| if t > acc.1 { (i, t) } else { acc },
        );
    let warning = (fast > 0.0 && slow > 1.15 * fast).then(|| {
        format!(
            "{} takes {:.0}% longer per step than the fastest device ({slow:.1} vs {fast:.1} ms); give it less with parallel.device_weights",
            load[slow_i].name,
            (slow / fast - 1.0) * 100.0
        )
    });
    (line, warning)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_report_names_a_slow_device() {
        let load = |name: &str, busy: f64| DeviceLoad {
            name: name.into(),
            images: 1280,
            steps: 10,
            busy_s: busy,
        };
        let (line, warn) = balance_report(&[load("cuda:0", 0.40), load("cuda:1", 0.50)]);
        assert!(line.contains("cuda:0 128 img/step 40.0 ms"), "{line}");
        assert!(warn.unwrap().starts_with("cuda:1 takes 25% longer"));
        assert!(
            balance_report(&[load("a", 0.40), load("b", 0.44)])
                .1
                .is_none()
        );
    }
}
