//! Writes the bundled MNIST (or Fashion-MNIST) out as NumPy arrays, an `.npz`, CSV tables and
//! PNG folders, for the format benchmark (`benches/formats.sh`) and for trying `--dataset`
//! formats by hand:
//!
//! ```text
//! cargo run --release -p ringtmp-testkit --example write_formats -- OUT [TRAIN TEST [DATASET]]
//! ```

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(out) = args.first() else {
        eprintln!("usage: write_formats OUT [TRAIN TEST [DATASET]]");
        std::process::exit(2);
    };
    let number = |i: usize, default: usize| {
        args.get(i)
            .map_or(default, |a| a.parse().expect("a count of examples"))
    };
    let dataset = args.get(3).map_or("mnist", String::as_str);
    let data = ringtmp_data::load(dataset, None).expect("the bundled dataset");
    let started = std::time::Instant::now();
    let written = ringtmp_testkit::formats::write_all(
        &data,
        std::path::Path::new(out),
        number(1, data.train.len()),
        number(2, data.test.len()),
    );
    eprintln!(
        "wrote {dataset} to {out} in {:.1}s: {written:?}",
        started.elapsed().as_secs_f64()
    );
}
