//! Ports for servers a test starts itself.

use std::net::TcpListener;

/// A free TCP port on 127.0.0.1: bound and released, so a small race with other processes
/// remains; callers that can bind port 0 themselves should.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_free_port_can_be_bound() {
        let port = super::free_port().unwrap();
        assert!(port > 0);
        std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    }
}
