//! The agent's layering, checked: its rooms (the top-level modules of `agent/src`: `kernel`,
//! `reconcile`, `snapshot`, `provision`, `serve`, …) must form a directed acyclic graph, where
//! a room depends on another when its code (tests aside) names `crate::<other>`. A circle
//! (kernel → reconcile → kernel) means neither can be read, tested or changed alone; the
//! shared types they hand each other belong in a module below both (`snapshot`).
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

use anyhow::{Context, Result};

/// Fails, naming the circle, if the agent's rooms depend on each other in one.
pub fn check() -> Result<()> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/src");
    if let Some(circle) = circle(&graph(&src)?) {
        anyhow::bail!("the agent's rooms depend on each other in a circle: {}", circle.join(" -> "));
    }
    Ok(())
}

/// Room -> the rooms its non-test code names.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The room-level dependencies of the crate whose `src` is `src`.
pub fn graph(src: &Path) -> Result<Graph> {
    let mut graph = Graph::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).with_context(|| format!("cannot read {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src)?;
            let room = relative.components().next().and_then(|c| c.as_os_str().to_str()).unwrap_or_default().trim_end_matches(".rs").to_string();
            if matches!(room.as_str(), "lib" | "main") {
                continue;
            }
            let text = fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
            let used = graph.entry(room.clone()).or_default();
            for other in named_rooms(&text) {
                if other != room {
                    used.insert(other);
                }
            }
        }
    }
    Ok(graph)
}

/// The rooms a file's code names: `crate::room` paths and the items of `use crate::{room, …}`
/// lists, outside comments and the file's test module.
fn named_rooms(text: &str) -> BTreeSet<String> {
    let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
    let code: String = code.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n");
    let ident = |s: &str| -> String { s.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect() };
    let mut rooms = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let after = &code[at + "crate::".len()..];
        let Some(list) = after.strip_prefix('{') else {
            rooms.insert(ident(after));
            continue;
        };
        // The list's top-level items, up to its closing brace.
        let (mut depth, mut item) = (0usize, String::new());
        for c in list.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    rooms.insert(ident(&item));
                    item.clear();
                    continue;
                }
                _ => {}
            }
            if depth == 0 {
                item.push(c);
            }
        }
        rooms.insert(ident(&item));
    }
    rooms.retain(|room| !room.is_empty() && room != "self");
    rooms
}

/// A circle of rooms, if the graph has one (the rooms in order, the first repeated last).
pub fn circle(graph: &Graph) -> Option<Vec<String>> {
    // Depth-first search; a room met again while on the path closes a circle.
    fn visit<'a>(room: &'a str, graph: &'a Graph, path: &mut Vec<&'a str>, done: &mut BTreeSet<&'a str>) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|r| *r == room) {
            let mut circle: Vec<String> = path[at..].iter().map(|r| r.to_string()).collect();
            circle.push(room.to_string());
            return Some(circle);
        }
        if !done.insert(room) {
            return None;
        }
        path.push(room);
        for next in graph.get(room).into_iter().flatten() {
            if graph.contains_key(next) {
                if let Some(circle) = visit(next, graph, path, done) {
                    return Some(circle);
                }
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|room| visit(room, graph, &mut Vec::new(), &mut done))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agents_rooms_form_no_circle() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/src");
        let graph = graph(&src).expect("the agent's sources");
        for room in ["kernel", "reconcile", "snapshot", "provision", "serve", "ledgers", "driver", "discovery"] {
            assert!(graph.contains_key(room), "room {room} not found: {graph:?}");
        }
        assert!(graph["reconcile"].contains("kernel"), "the parser sees the rooms' dependencies: {graph:?}");
        if let Some(circle) = circle(&graph) {
            panic!("the agent's rooms depend on each other in a circle: {}", circle.join(" -> "));
        }
    }

    #[test]
    fn a_circle_is_found_through_paths_and_use_lists_but_not_through_tests_or_comments() {
        let dir = std::env::temp_dir().join(format!("xtask-layers-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("a")).expect("dir");
        fs::write(dir.join("a/mod.rs"), "use crate::{\n    b::Thing,\n    c::{self, Other},\n};\n").expect("write");
        fs::write(dir.join("b.rs"), "// crate::a in a comment\nfn f() {}\n#[cfg(test)]\nmod tests {\n    use crate::a;\n}\n").expect("write");
        fs::write(dir.join("c.rs"), "pub fn g() -> crate::b::Thing { crate::b::Thing }\n").expect("write");
        let rooms = graph(&dir).expect("graph");
        assert_eq!(rooms["a"], BTreeSet::from(["b".to_string(), "c".to_string()]));
        assert!(rooms["b"].is_empty(), "{rooms:?}");
        assert_eq!(circle(&rooms), None);
        fs::write(dir.join("b.rs"), "fn f() -> crate::c::X { crate::c::X }\nuse crate::{a::{x, y}, d};\n").expect("write");
        let rooms = graph(&dir).expect("graph");
        assert_eq!(rooms["b"], BTreeSet::from(["a".to_string(), "c".to_string(), "d".to_string()]));
        let circle = circle(&rooms).expect("a -> b -> a");
        assert_eq!(circle.first(), circle.last());
        assert!(circle.len() >= 3, "{circle:?}");
        let _ = fs::remove_dir_all(&dir);
    }
}
