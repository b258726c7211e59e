//! Users from the sandbox's own `/etc/passwd`, read directly rather than through libc's `getpwnam`: the agent is
//! a static binary put into images of every kind (glibc, musl, busybox-only), and a static glibc's name service
//! would try to load the image's NSS modules, which need not exist or match. `/etc/passwd` is what every such
//! image has; users only in LDAP or systemd-homed are not looked up (a sandbox has neither).

use std::path::PathBuf;

/// One `/etc/passwd` line: `name:password:uid:gid:gecos:home:shell`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub dir: PathBuf,
}

/// The user `name` in `text` (an `/etc/passwd`), the first line naming it; malformed lines are skipped.
pub fn find(text: &str, name: &str) -> Option<User> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 || f[0] != name {
            return None;
        }
        Some(User { name: f[0].to_string(), uid: f[2].parse().ok()?, gid: f[3].parse().ok()?, dir: f[5].into() })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_users_and_skips_what_is_not_a_user() {
        let text = "# comment\nroot:x:0:0:root:/root:/bin/sh\nbroken:x:1\nuser:x:1000:1000:,,,:/home/user:/bin/bash\n\
                    bad:x:notanumber:1:::/bin/sh\n";
        assert_eq!(
            find(text, "user"),
            Some(User { name: "user".into(), uid: 1000, gid: 1000, dir: "/home/user".into() })
        );
        assert_eq!(find(text, "root").map(|u| (u.uid, u.dir)), Some((0, "/root".into())));
        assert_eq!(find(text, "broken"), None);
        assert_eq!(find(text, "bad"), None);
        assert_eq!(find(text, "nobody"), None);
        assert_eq!(find(text, "us"), None, "a prefix is not a name");
    }
}
