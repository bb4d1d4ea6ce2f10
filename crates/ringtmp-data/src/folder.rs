//! One folder of images per class, as torchvision's `ImageFolder` reads them: the class folders
//! sorted by name give the class indices; PNG and JPEG files are read (other files are skipped),
//! converted to grey or RGB and resized (bilinear, torchvision's default) to the declared shape.
//!
//! `DIR` with `train/` and `test/` (or `val/`) folders inside gives both splits; two directories
//! name them; one directory of class folders is split by the seeded validation fraction.
//! Images are decoded once, on every core, into bytes (channels last).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use image::imageops::FilterType;

use crate::description::{DataSource, Loaded};
use crate::error::{Error, Result};
use crate::recipe::Layout;
use crate::rows::{Dtype, Labels, RowData};

/// File extensions read as images (compared case-insensitively).
const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

pub(crate) fn load(source: &DataSource) -> Result<Loaded> {
    let root = &source.files[0];
    let roots: Vec<PathBuf> = if source.files.len() == 2 {
        source.files.clone()
    } else if root.join("train").is_dir() {
        let test = ["test", "val"]
            .iter()
            .map(|t| root.join(t))
            .find(|d| d.is_dir());
        std::iter::once(root.join("train")).chain(test).collect()
    } else {
        vec![root.clone()]
    };
    for r in &roots {
        if !r.is_dir() {
            return Err(source.error(format!("{} is not a directory", r.display())));
        }
    }
    let classes = class_folders(&roots[0])?;
    if classes.is_empty() {
        return Err(source.error(format!(
            "{} has no class folders (one folder of images per class)",
            roots[0].display()
        )));
    }
    let mut listed = Vec::new();
    for r in &roots {
        let mut files = Vec::new();
        for name in class_folders(r)? {
            let Ok(class) = classes.binary_search(&name) else {
                return Err(source.error(format!(
                    "{}: class folder {name:?} is not among the training classes",
                    r.display()
                )));
            };
            let images = images_in(&r.join(&name))?;
            // A class with no image in the training folder could never be learned, and it
            // would still take an output: refuse it rather than train a class that is not there.
            if images.is_empty() && std::ptr::eq(r, &roots[0]) {
                return Err(source.error(format!(
                    "{}: class folder {name:?} holds no PNG or JPEG image (remove it, or add \
                     its images)",
                    r.display()
                )));
            }
            for f in images {
                files.push((f, class as u32));
            }
        }
        if files.is_empty() {
            return Err(source.error(format!("{}: no PNG or JPEG images", r.display())));
        }
        listed.push(files);
    }
    let shape = match source.input_shape {
        Some(s) => s,
        None => {
            let first = &listed[0][0].0;
            let img = decode(first)?;
            let channels = if img.color().has_color() { 3 } else { 1 };
            (img.height() as usize, img.width() as usize, channels)
        }
    };
    if !matches!(shape.2, 1 | 3) {
        return Err(source.error(format!(
            "images are read as grey (1 channel) or RGB (3): {} channels declared",
            shape.2
        )));
    }
    let resize = source.input_shape.is_some();
    let mut splits = Vec::new();
    for files in &listed {
        let pixels = decode_all(files, shape, resize)?;
        let labels = Labels::Classes(files.iter().map(|(_, c)| *c).collect());
        splits.push(Arc::new(RowData::owned(
            pixels,
            Dtype::U8,
            shape.0 * shape.1 * shape.2,
            labels,
        )));
    }
    let mut splits = splits.into_iter();
    Ok(Loaded {
        train: splits.next().expect("a training folder"),
        test: splits.next(),
        shape,
        layout: Layout::Nhwc,
        scale: 1.0 / 255.0,
        channels: shape.2,
        columns: Vec::new(),
        label: None,
        targets: Vec::new(),
        class_names: classes,
        dir: root.clone(),
    })
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    }
}

/// The sub-folders of `dir` (not hidden), sorted by name.
pub(crate) fn class_folders(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_dir() && !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort_unstable();
    Ok(names)
}

/// The image files of `dir`, sorted by name.
pub(crate) fn images_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        let is_image = path.extension().is_some_and(|e| {
            EXTENSIONS
                .iter()
                .any(|x| e.to_string_lossy().eq_ignore_ascii_case(x))
        });
        if is_image && path.is_file() {
            files.push(path);
        }
    }
    files.sort_unstable();
    Ok(files)
}

fn decode(path: &Path) -> Result<image::DynamicImage> {
    image::ImageReader::open(path)
        .map_err(io(path))?
        .with_guessed_format()
        .map_err(io(path))?
        .decode()
        .map_err(|e| Error::Format {
            path: path.to_path_buf(),
            offset: 0,
            reason: format!("does not decode as an image: {e}"),
        })
}

/// One image's bytes at `shape` (channels last).
pub(crate) fn pixels_of(
    path: &Path,
    shape: (usize, usize, usize),
    resize: bool,
) -> Result<Vec<u8>> {
    let mut img = decode(path)?;
    let (h, w, c) = shape;
    if (img.height() as usize, img.width() as usize) != (h, w) {
        if !resize {
            return Err(Error::Format {
                path: path.to_path_buf(),
                offset: 0,
                reason: format!(
                    "{}×{} pixels, but the first image is {h}×{w}: declare --input-shape \
                     H,W,C to resize every image to one size",
                    img.height(),
                    img.width()
                ),
            });
        }
        img = img.resize_exact(w as u32, h as u32, FilterType::Triangle);
    }
    Ok(if c == 1 {
        img.into_luma8().into_raw()
    } else {
        img.into_rgb8().into_raw()
    })
}

/// Every image of `files` decoded on every core, in order.
fn decode_all(
    files: &[(PathBuf, u32)],
    shape: (usize, usize, usize),
    resize: bool,
) -> Result<Vec<u8>> {
    let per_image = shape.0 * shape.1 * shape.2;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = files.len().div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    let mut out = Vec::with_capacity(part.len() * per_image);
                    for (path, _) in part {
                        out.extend(pixels_of(path, shape, resize)?);
                    }
                    Ok(out)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("an image decoder panicked"))
            .collect()
    });
    let mut pixels = Vec::with_capacity(files.len() * per_image);
    for part in parts {
        pixels.extend(part?);
    }
    Ok(pixels)
}
