//! The heart of space without I/O: the sandbox state machine (one transition
//! table), ids, timestamps, and the [`runtime::Runtime`] trait the drivers implement.

pub mod runtime;
pub mod state;

pub use state::{transition, InvalidTransition, SandboxEvent};

/// A new random id with a type prefix: `sb_`, `op_`, `cmd_`, `tpl_`, `snap_`.
/// 20 characters of lowercase base32: 100 bits, unique across hosts.
pub fn new_id(prefix: &str) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut raw = [0u8; 20];
    fill_random(&mut raw);
    let mut id = String::with_capacity(prefix.len() + 1 + raw.len());
    id.push_str(prefix);
    id.push('_');
    for b in raw {
        id.push(ALPHABET[(b & 31) as usize] as char);
    }
    id
}

/// A secret of 32 random bytes as 64 hex characters.
pub fn new_token() -> String {
    let mut raw = [0u8; 32];
    fill_random(&mut raw);
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

fn fill_random(buf: &mut [u8]) {
    // The OS RNG failing is not recoverable in any useful way for a server.
    if let Err(e) = getrandom::getrandom(buf) {
        panic!("the operating system's random number generator failed: {e}");
    }
}

/// Whether `id` looks like an id this server could have issued with `prefix`.
pub fn is_valid_id(id: &str, prefix: &str) -> bool {
    id.len() == prefix.len() + 21
        && id.starts_with(prefix)
        && id.as_bytes()[prefix.len()] == b'_'
        && id[prefix.len() + 1..]
            .bytes()
            .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
}

/// Now, as RFC 3339 UTC with milliseconds.
pub fn now_rfc3339() -> String {
    format_time(time::OffsetDateTime::now_utc())
}

/// `t` as RFC 3339 UTC with milliseconds.
pub fn format_time(t: time::OffsetDateTime) -> String {
    let t = t.to_offset(time::UtcOffset::UTC);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_valid_and_distinct() {
        let a = new_id("sb");
        let b = new_id("sb");
        assert_ne!(a, b);
        assert!(is_valid_id(&a, "sb"), "{a}");
        assert!(!is_valid_id(&a, "op"));
        assert!(!is_valid_id("sb_../../etc/passwd", "sb"));
        assert!(!is_valid_id("sb_", "sb"));
    }

    #[test]
    fn time_format() {
        let t = time::macros::datetime!(2026-01-02 03:04:05.678 UTC);
        assert_eq!(format_time(t), "2026-01-02T03:04:05.678Z");
        assert_eq!(now_rfc3339().len(), 24);
    }
}
