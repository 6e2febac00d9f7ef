//! `*` patterns, as the operator writes them in the limits file (cgroup paths) and the quota
//! file's selectors (namespaces, pods, containers).

/// Whether `text` matches `pattern`, where `*` matches any run of characters.
pub fn matches(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    for (index, part) in parts.iter().enumerate() {
        let last = index + 1 == parts.len();
        if last {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        assert!(matches("/a/b", "/a/b"));
        assert!(!matches("/a/b", "/a/bc"));
        assert!(matches("/kubepods/*", "/kubepods/pod1/c1"));
        assert!(matches("/kubepods/*pod1*", "/kubepods/burstable/pod1/c1"));
        assert!(!matches("/kubepods/*pod2*", "/kubepods/burstable/pod1/c1"));
        assert!(matches("*", "/anything"));
        assert!(matches("/x/*/y", "/x/1/2/y"));
        assert!(!matches("/x/*/y", "/x/1/2/z"));
    }
}
