//! Who a command runs as. The agent is a static binary with no NSS, so
//! `/etc/passwd` and `/etc/group` are read by hand, at each spawn (the
//! sandbox may change them).

/// The identity a command runs under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// From `/etc/passwd`, else `/root` for root and `/` for anyone else.
    pub home: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct PasswdEntry {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

/// `name:passwd:uid:gid:gecos:home:shell`; malformed lines are skipped.
fn parse_passwd(text: &str) -> Vec<PasswdEntry> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 6 || f[0].is_empty() {
                return None;
            }
            Some(PasswdEntry {
                name: f[0].to_string(),
                uid: f[2].parse().ok()?,
                gid: f[3].parse().ok()?,
                home: f[5].to_string(),
            })
        })
        .collect()
}

/// `name:passwd:gid:members`; malformed lines are skipped.
fn parse_group(text: &str) -> Vec<(String, u32)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|line| {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() < 3 || f[0].is_empty() {
                return None;
            }
            Some((f[0].to_string(), f[2].parse().ok()?))
        })
        .collect()
}

fn is_numeric(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

fn default_home(uid: u32) -> String {
    if uid == 0 { "/root" } else { "/" }.to_string()
}

/// Resolves a `SpawnRequest::user` (`None` = root; `name`, `uid`, `name:group` or
/// `uid:gid`, each part a name or a number) against the given file contents.
///
/// A numeric uid without a passwd entry gets the same number as its gid.
pub fn resolve(spec: Option<&str>, passwd: &str, group: &str) -> Result<Identity, String> {
    let entries = parse_passwd(passwd);
    let Some(spec) = spec else {
        let home = entries
            .iter()
            .find(|e| e.uid == 0)
            .map(|e| e.home.clone())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| default_home(0));
        return Ok(Identity {
            uid: 0,
            gid: 0,
            home,
        });
    };
    let (user, grp) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let (uid, entry) = if is_numeric(user) {
        let uid: u32 = user.parse().map_err(|_| format!("invalid uid '{user}'"))?;
        (uid, entries.iter().find(|e| e.uid == uid))
    } else {
        let e = entries
            .iter()
            .find(|e| e.name == user)
            .ok_or_else(|| format!("unknown user '{user}'"))?;
        (e.uid, Some(e))
    };
    let gid = match grp {
        Some(g) if is_numeric(g) => g.parse().map_err(|_| format!("invalid gid '{g}'"))?,
        Some(g) => parse_group(group)
            .into_iter()
            .find(|(name, _)| name == g)
            .map(|(_, gid)| gid)
            .ok_or_else(|| format!("unknown group '{g}'"))?,
        None => entry.map(|e| e.gid).unwrap_or(uid),
    };
    let home = entry
        .map(|e| e.home.clone())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| default_home(uid));
    Ok(Identity { uid, gid, home })
}

/// [`resolve`] against the real files; a missing file counts as empty.
pub fn lookup(spec: Option<&str>) -> Result<Identity, String> {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    let group = std::fs::read_to_string("/etc/group").unwrap_or_default();
    resolve(spec, &passwd, &group)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
                          # comment\n\
                          broken line\n\
                          alice:x:1000:1001:Alice:/home/alice:/bin/bash\n\
                          nohome:x:1002:1002:::/bin/sh\n";
    const GROUP: &str = "root:x:0:\nstaff:x:50:alice\nbad:x:zz:\n";

    fn id(uid: u32, gid: u32, home: &str) -> Identity {
        Identity {
            uid,
            gid,
            home: home.into(),
        }
    }

    #[test]
    fn resolves_names_and_numbers() {
        assert_eq!(resolve(None, PASSWD, GROUP), Ok(id(0, 0, "/root")));
        assert_eq!(resolve(None, "", ""), Ok(id(0, 0, "/root")));
        assert_eq!(
            resolve(Some("alice"), PASSWD, GROUP),
            Ok(id(1000, 1001, "/home/alice"))
        );
        assert_eq!(
            resolve(Some("1000"), PASSWD, GROUP),
            Ok(id(1000, 1001, "/home/alice"))
        );
        assert_eq!(
            resolve(Some("4242"), PASSWD, GROUP),
            Ok(id(4242, 4242, "/"))
        );
        assert_eq!(resolve(Some("5:7"), PASSWD, GROUP), Ok(id(5, 7, "/")));
        assert_eq!(
            resolve(Some("alice:staff"), PASSWD, GROUP),
            Ok(id(1000, 50, "/home/alice"))
        );
        assert_eq!(
            resolve(Some("nohome"), PASSWD, GROUP),
            Ok(id(1002, 1002, "/"))
        );
    }

    #[test]
    fn rejects_unknown_and_invalid() {
        assert!(resolve(Some("bob"), PASSWD, GROUP).is_err());
        assert!(resolve(Some("alice:nogroup"), PASSWD, GROUP).is_err());
        assert!(resolve(Some("99999999999"), PASSWD, GROUP).is_err());
        assert!(resolve(Some(""), PASSWD, GROUP).is_err());
        assert!(resolve(Some("1:"), PASSWD, GROUP).is_err());
    }
}
