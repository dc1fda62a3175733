//! API paths (`?path=` of every files request): parsed components are bounded,
//! never `..` or empty, and re-joining them parses to the same components.
#![no_main]

use libfuzzer_sys::fuzz_target;
use space_agent::fs::parse_path;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(comps) = parse_path(s) {
        assert!(s.len() <= 4096);
        for c in &comps {
            assert!(!c.is_empty() && c != "." && c != "..");
            assert!(!c.contains('/') && !c.contains('\0'));
            assert!(c.len() <= 255);
        }
        let joined = format!("/{}", comps.join("/"));
        assert_eq!(parse_path(&joined).expect("re-parses"), comps);
    }
});
