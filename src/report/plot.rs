//! `curves.png`: loss and accuracy per epoch, train and test, side by side.
//!
//! plotters draws into an RGB buffer that the `image` crate encodes, with the DejaVu
//! Sans font compiled in, so the labels show on machines without any fonts (GPU
//! containers often have none).

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use super::EpochRecord;

const W: u32 = 1200;
const H: u32 = 450;

pub fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .unwrap_or_else(|_| panic!("the bundled DejaVu Sans font should parse"));
    });
}

type Series<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

pub fn write_curves(path: &Path, history: &[EpochRecord]) -> Result<(), String> {
    register_font();
    let mut buf = vec![255u8; (W * H * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let (left, right) = root.split_horizontally(W / 2);
        let pts = |f: fn(&EpochRecord) -> f64| -> Vec<(f64, f64)> {
            history
                .iter()
                .map(|r| (r.epoch as f64, f(r)))
                .filter(|(_, v)| v.is_finite())
                .collect()
        };
        panel(
            &left,
            "loss",
            &[
                ("train", BLUE, pts(|r| r.train_loss)),
                ("test", RED, pts(|r| r.test_loss)),
            ],
        )?;
        panel(
            &right,
            "accuracy",
            &[
                ("train", BLUE, pts(|r| r.train_acc)),
                ("test", RED, pts(|r| r.test_acc)),
            ],
        )?;
        root.present().map_err(|e| e.to_string())?;
    }
    let img = image::RgbImage::from_raw(W, H, buf).expect("buffer matches the image size");
    let tmp = path.with_extension("tmp.png");
    let saved = img
        .save(&tmp)
        .map_err(|e| e.to_string())
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| e.to_string()));
    if saved.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    saved
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    series: &[Series],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let all: Vec<&(f64, f64)> = series.iter().flat_map(|s| s.2.iter()).collect();
    let x_max = all.iter().map(|p| p.0).fold(1.0, f64::max);
    let (mut lo, mut hi) = all.iter().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    if lo > hi {
        (lo, hi) = (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let mut chart = ChartBuilder::on(area)
        .margin(15)
        .caption(title, ("sans-serif", 22))
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..x_max, (lo - pad)..(hi + pad))
        .map_err(|e| e.to_string())?;
    // As many labels as epochs (up to 12) puts the ticks on whole epochs.
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc(title)
        .x_labels((x_max as usize + 1).min(12))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|e| e.to_string())?;
    for (name, color, points) in series {
        let color = *color;
        let drawn = chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
        drawn.label(*name).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
        });
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    draw_legend(&mut chart)
}

/// The legend of `chart`'s labelled series, boxed, as every kiln plot draws it.
pub fn draw_legend<'a, DB, CT>(chart: &mut ChartContext<'a, DB, CT>) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
    DB::ErrorType: 'static,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png_of_the_expected_size() {
        let dir = crate::test_util::tempdir();
        let rec = |epoch: u32, acc: f64| EpochRecord {
            epoch,
            step: epoch as u64 * 10,
            lr: 0.1,
            train_loss: 1.0 / epoch as f64,
            train_acc: acc,
            test_loss: if epoch == 2 {
                f64::NAN
            } else {
                1.2 / epoch as f64
            },
            test_acc: if epoch == 2 { f64::NAN } else { acc - 0.05 },
            img_per_s: 100.0,
            data_wait_s: 0.0,
            epoch_time_s: 1.0,
        };
        let path = dir.path().join("curves.png");
        write_curves(&path, &[rec(1, 0.5), rec(2, 0.7), rec(3, 0.8)]).unwrap();
        let img = image::open(&path).unwrap();
        assert_eq!((img.width(), img.height()), (W, H));
    }
}
