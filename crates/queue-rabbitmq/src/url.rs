//! AMQP URLs in logs and errors: the password replaced.

/// `url` with the password of its user info replaced by `***`
/// (`amqp://guest:***@127.0.0.1:5672/%2f`); anything else unchanged.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The user info ends at the last '@': a password written without percent-encoding may
    // hold '/', '?' or '#', and none of it may show.
    match rest.rsplit_once('@') {
        Some((userinfo, host_and_tail)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let masked = if userinfo.contains(':') { ":***" } else { "" };
            format!("{scheme}://{user}{masked}@{host_and_tail}")
        }
        None => url.to_owned(),
    }
}

/// Whether `url` parses as an AMQP URI (`amqp://user:pass@host:port/vhost`, or `amqps://`).
pub fn is_valid_url(url: &str) -> bool {
    url.parse::<lapin::uri::AMQPUri>().is_ok()
}

/// Whether `url` connects with TLS: its scheme is `amqps`.
pub fn is_tls_url(url: &str) -> bool {
    url.parse::<lapin::uri::AMQPUri>()
        .is_ok_and(|uri| uri.scheme == lapin::uri::AMQPScheme::AMQPS)
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn hides_the_password_only() {
        assert_eq!(
            redact_url("amqp://guest:s3cr%2Ft@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact_url("amqp://user@h/v"), "amqp://user@h/v");
        assert_eq!(redact_url("amqp://h:5672"), "amqp://h:5672");
        assert_eq!(redact_url("amqp://u:p@h?x=1"), "amqp://u:***@h?x=1");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(
            redact_url("amqp://u:p#a/s?s@h:5672/%2f"),
            "amqp://u:***@h:5672/%2f"
        );
    }
}
