//! Rules about the sources themselves, read with `syn`: no import circle in any crate; no
//! strategy crate depends on another (so the contract and the collective layer below them name
//! none), and inside the data-parallel family no strategy names another; the libraries print
//! nothing.
//!
//! No import circle: the files of a crate, as nodes, and "file A names an item defined in file
//! B" as edges, form a graph without cycles.
//!
//! Why: a circle makes two files one unit in disguise — neither can be read, tested or moved
//! without the other — and circles grow. The layering this keeps: a contract module that names
//! no strategy, strategies that name the contract and not each other, a `Job` enum on top that
//! names them all; Cargo keeps it between crates, this test reads the manifests to say so and the
//! sources for the strategies that share one crate.
//!
//! How the graph is read (with `syn`, from the sources):
//! - a file's module path comes from where it lies (`src/ring/run/driver.rs` is
//!   `crate::ring::run::driver`, `src/ring/mod.rs` is `crate::ring`); inline modules belong to
//!   their file;
//! - every path in a `use` and in the code (`crate::…`, `super::…`, `self::…`, or starting with a
//!   child module's name) is resolved to the longest module prefix that exists, and then, when the
//!   next segment is a `pub use` re-export of that module, through the re-export to the file that
//!   defines the item: a re-export is an alias, not a dependency;
//! - `pub use` items themselves make no edge, `mod` declarations make none, and code under
//!   `#[cfg(test)]` makes none (a test may reach anywhere).
//!
//! - the arguments of a macro invocation (`format!("{}", crate::ring::NAME)`) are read as the
//!   comma-separated expressions they are, where they parse so.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module path inside one crate, without the leading `crate`.
type ModPath = Vec<String>;

/// One source file of a crate: where it is and what module it is.
struct SourceFile {
    path: PathBuf,
    module: ModPath,
    ast: syn::File,
}

/// Every module (file or inline) of a crate, and the file that holds it.
struct Crate {
    name: String,
    files: Vec<SourceFile>,
    /// Module → index into `files`.
    module_file: BTreeMap<ModPath, usize>,
    /// Module → (re-exported name → the full path it names).
    reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>>,
    /// Modules declared under `#[cfg(test)]` (`#[cfg(test)] mod gradcheck;`): their files are
    /// test code.
    test_only: BTreeSet<ModPath>,
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the testkit lies at crates/ringtmp-testkit")
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/ring/run/driver.rs` → `[ring, run, driver]`; `src/ring/mod.rs` and `src/lib.rs` drop their file name.
fn module_of(src: &Path, file: &Path) -> ModPath {
    let relative = file.strip_prefix(src).expect("a file under src");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.meta
                .require_list()
                .is_ok_and(|l| l.tokens.to_string().contains("test"))
    })
}

fn is_public(vis: &syn::Visibility) -> bool {
    !matches!(vis, syn::Visibility::Inherited)
}

/// The leaves of a `use` tree as full paths (segments, with `*` for a glob) and the name each
/// is known by here.
fn use_leaves(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_leaves(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            let mut full = prefix.clone();
            if name != "self" {
                full.push(name.clone());
            }
            let known = if name == "self" {
                prefix.last().cloned().unwrap_or_default()
            } else {
                name
            };
            out.push((full, known));
        }
        syn::UseTree::Rename(r) => {
            let mut full = prefix.clone();
            full.push(r.ident.to_string());
            out.push((full, r.rename.to_string()));
        }
        syn::UseTree::Glob(_) => {
            let mut full = prefix.clone();
            full.push("*".into());
            out.push((full, "*".into()));
        }
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_leaves(t, prefix, out);
            }
        }
    }
}

impl Crate {
    fn read(dir: &Path) -> Self {
        let src = dir.join("src");
        let mut paths = Vec::new();
        rust_files(&src, &mut paths);
        let mut files = Vec::new();
        for path in paths {
            let text = std::fs::read_to_string(&path).expect("a readable source file");
            let ast = syn::parse_file(&text)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            files.push(SourceFile {
                module: module_of(&src, &path),
                path,
                ast,
            });
        }
        let mut krate = Crate {
            name: dir.file_name().unwrap().to_string_lossy().into_owned(),
            files,
            module_file: BTreeMap::new(),
            reexports: BTreeMap::new(),
            test_only: BTreeSet::new(),
        };
        krate.index();
        krate
    }

    /// Every module first (a re-export may name a module of a later file), then the inline
    /// modules and re-exports.
    fn index(&mut self) {
        for (i, file) in self.files.iter().enumerate() {
            self.module_file.insert(file.module.clone(), i);
        }
        for i in 0..self.files.len() {
            let module = self.files[i].module.clone();
            let items = self.files[i].ast.items.clone();
            self.index_items(&items, &module, i);
        }
    }

    /// Records inline modules and the `pub use` re-exports of `module` (held by file `file`).
    fn index_items(&mut self, items: &[syn::Item], module: &ModPath, file: usize) {
        for item in items {
            match item {
                syn::Item::Mod(m) if is_cfg_test(&m.attrs) => {
                    let mut child = module.clone();
                    child.push(m.ident.to_string());
                    self.test_only.insert(child);
                }
                syn::Item::Mod(m) => {
                    if let Some((_, inner)) = &m.content {
                        let mut child = module.clone();
                        child.push(m.ident.to_string());
                        self.module_file.insert(child.clone(), file);
                        self.index_items(inner, &child, file);
                    }
                }
                syn::Item::Use(u) if is_public(&u.vis) => {
                    let mut leaves = Vec::new();
                    use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                    for (path, name) in leaves {
                        if name != "*" {
                            let full = self.absolute(module, &path);
                            if let Some(full) = full {
                                self.reexports
                                    .entry(module.clone())
                                    .or_default()
                                    .insert(name, full);
                            }
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// `path` as written in `module`, made absolute (without `crate`); `None` when it names
    /// another crate or something not a module of this one.
    fn absolute(&self, module: &ModPath, path: &[String]) -> Option<ModPath> {
        let (first, rest) = path.split_first()?;
        let mut base = match first.as_str() {
            "crate" => Vec::new(),
            "self" => module.clone(),
            "super" => {
                let mut m = module.clone();
                m.pop()?;
                m
            }
            _ => {
                let mut child = module.clone();
                child.push(first.clone());
                if self.module_file.contains_key(&child) {
                    child
                } else {
                    return None;
                }
            }
        };
        let mut rest = rest;
        while let Some((s, tail)) = rest.split_first() {
            if s != "super" {
                break;
            }
            base.pop()?;
            rest = tail;
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The file that defines what the absolute `path` names: its longest module prefix, followed
    /// through re-exports (at most a few hops, as aliases of aliases are).
    fn defining_file(&self, path: &ModPath) -> Option<usize> {
        let mut path = path.clone();
        for _ in 0..8 {
            let depth = (0..=path.len())
                .rev()
                .find(|&d| self.module_file.contains_key(&path[..d]))?;
            let module = &path[..depth];
            let through = path
                .get(depth)
                .and_then(|name| self.reexports.get(module).and_then(|r| r.get(name)));
            match through {
                Some(target) if target != &path[..=depth] => {
                    let mut next = target.clone();
                    next.extend(path[depth + 1..].iter().cloned());
                    path = next;
                }
                _ => return self.module_file.get(module).copied(),
            }
        }
        None
    }

    /// Edges `file → defining file`, each with the first path that made it.
    fn edges(&self) -> BTreeMap<(usize, usize), String> {
        let mut edges = BTreeMap::new();
        for (i, file) in self.files.iter().enumerate() {
            if self.test_only.iter().any(|t| file.module.starts_with(t)) {
                continue;
            }
            let mut collector = PathCollector {
                krate: self,
                module: file.module.clone(),
                found: Vec::new(),
            };
            collector.items(&file.ast.items);
            for (module, path) in collector.found {
                let Some(full) = self.absolute(&module, &path) else {
                    continue;
                };
                if let Some(j) = self.defining_file(&full)
                    && j != i
                {
                    edges.entry((i, j)).or_insert_with(|| path.join("::"));
                }
            }
        }
        edges
    }
}

/// Every path named in a file's non-test code, with the module it is written in.
struct PathCollector<'a> {
    krate: &'a Crate,
    module: ModPath,
    found: Vec<(ModPath, Vec<String>)>,
}

impl PathCollector<'_> {
    fn items(&mut self, items: &[syn::Item]) {
        for item in items {
            self.visit_item(item);
        }
    }
}

impl<'ast> Visit<'ast> for PathCollector<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        match item {
            syn::Item::Mod(m) => {
                if is_cfg_test(&m.attrs) {
                    return;
                }
                if let Some((_, inner)) = &m.content {
                    self.module.push(m.ident.to_string());
                    self.items(inner);
                    self.module.pop();
                }
            }
            syn::Item::Use(u) => {
                if is_public(&u.vis) || is_cfg_test(&u.attrs) {
                    return;
                }
                let mut leaves = Vec::new();
                use_leaves(&u.tree, &mut Vec::new(), &mut leaves);
                for (mut path, _) in leaves {
                    if path.last().is_some_and(|s| s == "*") {
                        path.pop();
                    }
                    self.found.push((self.module.clone(), path));
                }
            }
            syn::Item::Fn(f) if is_cfg_test(&f.attrs) => {}
            syn::Item::Impl(i) if is_cfg_test(&i.attrs) => {}
            _ => syn::visit::visit_item(self, item),
        }
    }

    /// `pub(super)` names a module without depending on it.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    /// A macro's arguments are code too: read as comma-separated expressions where they parse
    /// so (`format!`, `vec!`, `assert!`); other macros' tokens are not read.
    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        use syn::parse::Parser;
        let parser = syn::punctuated::Punctuated::<syn::Expr, syn::Token![,]>::parse_terminated;
        if let Ok(args) = parser.parse2(mac.tokens.clone()) {
            for arg in &args {
                self.visit_expr(arg);
            }
        }
        syn::visit::visit_macro(self, mac);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        // A single name is either local, from the prelude, brought in by a `use` (which made its
        // own edge), or one this module re-exports: using that in the module's own code is a
        // dependency on the file that defines it.
        let reexported = |name: &String| {
            self.krate
                .reexports
                .get(&self.module)
                .is_some_and(|r| r.contains_key(name))
        };
        if segments.len() > 1
            || segments
                .first()
                .is_some_and(|s| s == "super" || reexported(s))
        {
            let mut full = vec!["self".to_string()];
            if segments.len() == 1 && segments[0] != "super" {
                full.extend(segments);
            } else {
                full = segments;
            }
            self.found.push((self.module.clone(), full));
        }
        syn::visit::visit_path(self, path);
    }
}

/// The strongly connected components of more than one file (Tarjan's algorithm).
fn circles(nodes: usize, edges: &BTreeMap<(usize, usize), String>) -> Vec<Vec<usize>> {
    struct Tarjan<'a> {
        next: Vec<Vec<usize>>,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        counter: usize,
        found: &'a mut Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.counter);
            self.low[v] = self.counter;
            self.counter += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for w in self.next[v].clone() {
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    Some(_) => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut next = vec![Vec::new(); nodes];
    for &(a, b) in edges.keys() {
        next[a].push(b);
    }
    let mut found = Vec::new();
    let mut t = Tarjan {
        next,
        index: vec![None; nodes],
        low: vec![0; nodes],
        on_stack: vec![false; nodes],
        stack: Vec::new(),
        counter: 0,
        found: &mut found,
    };
    for v in 0..nodes {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    found
}

fn crate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(workspace_root().join("crates"))
        .expect("the crates folder")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.join("src").is_dir())
        .collect();
    dirs.sort();
    dirs
}

/// What a circle is, for the failure message: its files and the edges among them.
fn describe(
    krate: &Crate,
    component: &[usize],
    edges: &BTreeMap<(usize, usize), String>,
) -> String {
    let root = workspace_root();
    let name = |i: usize| {
        krate.files[i]
            .path
            .strip_prefix(&root)
            .unwrap_or(&krate.files[i].path)
            .display()
            .to_string()
    };
    let members: BTreeSet<usize> = component.iter().copied().collect();
    let mut text = format!("{}: a circle of {} files:\n", krate.name, component.len());
    for (&(a, b), path) in edges {
        if members.contains(&a) && members.contains(&b) {
            text += &format!("  {} → {} (names {path})\n", name(a), name(b));
        }
    }
    text
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut report = String::new();
    let mut files = 0;
    for dir in crate_dirs() {
        let krate = Crate::read(&dir);
        files += krate.files.len();
        let edges = krate.edges();
        for component in circles(krate.files.len(), &edges) {
            report += &describe(&krate, &component, &edges);
        }
    }
    assert!(
        files > 50,
        "only {files} source files read: the walk is broken"
    );
    assert!(report.is_empty(), "import circles:\n{report}");
}

/// Whether a file implements `Strategy` (for some job type).
fn implements_strategy(file: &SourceFile) -> bool {
    struct Impls(bool);
    impl<'ast> Visit<'ast> for Impls {
        fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
            let names_strategy = i
                .trait_
                .as_ref()
                .and_then(|(_, path, _)| path.segments.last())
                .is_some_and(|s| s.ident == "Strategy");
            self.0 |= names_strategy;
        }
    }
    let mut found = Impls(false);
    found.visit_file(&file.ast);
    found.0
}

/// A crate's strategies: the top-level modules that implement `Strategy` somewhere inside them
/// (read from the code, so a new strategy is counted without editing a list).
fn strategies(krate: &Crate) -> BTreeSet<String> {
    krate
        .files
        .iter()
        .filter(|f| !f.module.is_empty() && implements_strategy(f))
        .map(|f| f.module[0].clone())
        .collect()
}

/// Whether a crate defines the `Job` enum, the one list of strategies (the crate on top, which
/// may name them all).
fn defines_job(krate: &Crate) -> bool {
    krate.files.iter().any(|f| {
        f.ast.items.iter().any(|item| match item {
            syn::Item::Enum(e) => e.ident == "Job",
            syn::Item::Macro(m) => m.mac.tokens.to_string().contains("pub enum Job"),
            _ => false,
        })
    })
}

/// The workspace crates a crate's manifest names under `[dependencies]` (not dev or build).
fn workspace_dependencies(dir: &Path) -> BTreeSet<String> {
    let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).expect("a manifest");
    let mut section = String::new();
    let mut found = BTreeSet::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line.to_string();
        } else if section == "[dependencies]"
            && let Some(name) = line.split(['.', ' ', '=']).next()
            && name.starts_with("ringtmp-")
        {
            found.insert(name.to_string());
        }
    }
    found
}

/// The crates' layering, kept by Cargo: a crate that implements a strategy depends (directly
/// or through others) on no crate that implements another, so the contract and the collective
/// layer below them name no strategy and no family names another; only the crate that defines
/// the `Job` enum, on top, depends on them all.
#[test]
fn no_strategy_crate_depends_on_another() {
    let crates: BTreeMap<String, (Crate, BTreeSet<String>)> = crate_dirs()
        .into_iter()
        .map(|dir| {
            let krate = Crate::read(&dir);
            (krate.name.clone(), (krate, workspace_dependencies(&dir)))
        })
        .collect();
    let holds_strategy = |name: &str| {
        crates
            .get(name)
            .is_some_and(|(k, _)| !strategies(k).is_empty())
    };
    let families: Vec<&String> = crates
        .keys()
        .filter(|n| holds_strategy(n) && !defines_job(&crates[*n].0))
        .collect();
    for known in [
        "ringtmp-ring",
        "ringtmp-data-parallel",
        "ringtmp-param-server",
    ] {
        assert!(
            families.iter().any(|f| *f == known),
            "{known} implements no Strategy: {families:?}"
        );
    }
    let mut wrong = Vec::new();
    for family in families {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<String> = crates[family].1.iter().cloned().collect();
        while let Some(dependency) = todo.pop() {
            if !seen.insert(dependency.clone()) {
                continue;
            }
            if holds_strategy(&dependency) {
                wrong.push(format!("{family} depends on {dependency}"));
            }
            if let Some((_, next)) = crates.get(&dependency) {
                todo.extend(next.iter().cloned());
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "strategy crates depending on another: {wrong:#?}"
    );
}

/// Inside a crate that holds several strategies (the data-parallel family), the same layering as
/// between crates: no strategy names another, and the modules they share (their loop, what they
/// plan and report alike) name none of them. The crate that defines `Job` is on top and may.
#[test]
fn strategies_in_one_crate_name_only_what_they_share() {
    let mut checked = Vec::new();
    let mut wrong = Vec::new();
    for dir in crate_dirs() {
        let krate = Crate::read(&dir);
        let strategies = strategies(&krate);
        if strategies.len() < 2 {
            continue;
        }
        checked.push(krate.name.clone());
        let on_top = defines_job(&krate);
        for ((from, to), path) in krate.edges() {
            let (a, b) = (&krate.files[from].module, &krate.files[to].module);
            let (Some(x), Some(y)) = (a.first(), b.first()) else {
                continue;
            };
            let names_strategy = x != y && strategies.contains(y);
            if names_strategy && (strategies.contains(x) || !on_top) {
                wrong.push(format!("{}: {} names {path}", krate.name, a.join("::")));
            }
        }
    }
    assert!(
        checked.iter().any(|c| c == "ringtmp-data-parallel"),
        "the data-parallel strategies were not found: {checked:?}"
    );
    assert!(
        wrong.is_empty(),
        "modules naming a strategy of their crate: {wrong:#?}"
    );
}

/// The checker finds a circle where there is one, and follows re-exports as aliases.
#[test]
fn a_circle_is_found_and_a_reexport_is_not_one() {
    let parse = |s: &str| syn::parse_file(s).expect("test source parses");
    let make = |sources: &[(&[&str], &str)]| {
        let mut krate = Crate {
            name: "toy".into(),
            files: sources
                .iter()
                .map(|(m, s)| SourceFile {
                    path: PathBuf::from(m.join("/")),
                    module: m.iter().map(|s| s.to_string()).collect(),
                    ast: parse(s),
                })
                .collect(),
            module_file: BTreeMap::new(),
            reexports: BTreeMap::new(),
            test_only: BTreeSet::new(),
        };
        krate.index();
        let edges = krate.edges();
        circles(krate.files.len(), &edges).len()
    };
    // a ↔ b through `use` and through a path in code.
    assert_eq!(
        make(&[
            (&[], "mod a; mod b;"),
            (&["a"], "use crate::b::B; pub struct A;"),
            (&["b"], "pub struct B; fn f() -> crate::a::A { todo!() }"),
        ]),
        1
    );
    // The parent re-exports a child's item, and the child's sibling names it through the parent:
    // the edge goes to the child, so parent and children form no circle.
    assert_eq!(
        make(&[
            (&[], "mod ring;"),
            (&["ring"], "mod a; mod b; pub use a::A; fn g(_: b::B) {}"),
            (&["ring", "a"], "pub struct A;"),
            (&["ring", "b"], "use super::A; pub struct B(A);"),
        ]),
        0
    );
    // A parent whose own code uses a child's type that it re-exports depends on that child; the
    // child naming the parent's own item closes a circle.
    assert_eq!(
        make(&[
            (&[], "mod layers;"),
            (
                &["layers"],
                "mod pool; pub use pool::Pool; pub struct Aux; pub enum Kind { P(Pool) }"
            ),
            (&["layers", "pool"], "use super::Aux; pub struct Pool(Aux);"),
        ]),
        1
    );
    // A test module reaching back is no circle.
    assert_eq!(
        make(&[
            (&[], "mod a; mod b;"),
            (&["a"], "use crate::b::B; pub struct A;"),
            (
                &["b"],
                "pub struct B; #[cfg(test)] mod tests { use crate::a::A; }"
            ),
        ]),
        0
    );
    // A path inside a macro's arguments is an edge like any other.
    assert_eq!(
        make(&[
            (&[], "mod a; mod b;"),
            (&["a"], "use crate::b::B; pub const A: &str = \"a\";"),
            (
                &["b"],
                "pub struct B; fn f() -> String { format!(\"{}\", crate::a::A) }"
            ),
        ]),
        1
    );
}

/// Every `print!`-family macro in a library crate's non-test code, as `file: fn`.
struct PrintFinder {
    file: String,
    function: String,
    found: Vec<String>,
}

impl<'ast> Visit<'ast> for PrintFinder {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            _ => &Vec::new(),
        };
        if is_cfg_test(attrs) {
            return;
        }
        if let syn::Item::Fn(f) = item {
            self.function = f.sig.ident.to_string();
        }
        syn::visit::visit_item(self, item);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        self.function = f.sig.ident.to_string();
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        if ["println", "eprintln", "print", "eprint"]
            .iter()
            .any(|name| m.path.is_ident(name))
        {
            self.found.push(format!("{}: {}", self.file, self.function));
        }
    }
}

/// The libraries print nothing: what a planner chose comes back as a `PlanReport`, what a run
/// handled as `Event::Notice`s, and the CLI decides what to show. The one exception prints a
/// simulation test's seed so that a failing test says how to replay it.
#[test]
fn the_libraries_print_nothing() {
    let allowed = ["crates/ringtmp-transport/src/sim.rs: test_seed"];
    let root = workspace_root();
    let mut found = Vec::new();
    for dir in crate_dirs() {
        if !dir.join("src/lib.rs").exists() || dir.ends_with("ringtmp-testkit") {
            continue;
        }
        let krate = Crate::read(&dir);
        for file in &krate.files {
            if krate.test_only.iter().any(|t| file.module.starts_with(t)) {
                continue;
            }
            let mut finder = PrintFinder {
                file: file
                    .path
                    .strip_prefix(&root)
                    .unwrap_or(&file.path)
                    .display()
                    .to_string(),
                function: String::new(),
                found: Vec::new(),
            };
            finder.visit_file(&file.ast);
            found.extend(finder.found);
        }
    }
    found.retain(|f| !allowed.contains(&f.as_str()));
    assert!(found.is_empty(), "library code that prints: {found:#?}");
}
