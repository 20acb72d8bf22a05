//! Image references (the grammar is `berth_proto::reference`'s, shared with the server's release
//! resolution), container names and compose project names from task payloads.

pub(crate) use berth_proto::reference::{is_sha256_digest, parse_image, ImageRef};

/// Docker's container name grammar, with room left for `-previous-<unix ms>`.
pub(crate) use berth_proto::payload::valid_container_name;

/// Compose project names: the rule is `berth_proto::payload`'s, so create refuses what this does.
pub(crate) use berth_proto::payload::valid_project_name;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_names() {
        assert!(valid_container_name("web-1.blue_x"));
        for bad in ["", "-web", "a/b", "a b", "a$b", &"a".repeat(101)] {
            assert!(!valid_container_name(bad), "{bad:?}");
        }
        assert!(valid_project_name("shop-prod_1"));
        for bad in ["", "Shop", "_x", "a.b", "a b"] {
            assert!(!valid_project_name(bad), "{bad:?}");
        }
    }
}
