use pinned_pool::{ConfigError, POOL_CONF_VAR, PoolConfig};

#[test]
fn the_environment_variable_configures_the_pool() {
    // SAFETY: this binary's other tests do not read the variable.
    unsafe { std::env::set_var(POOL_CONF_VAR, "max_cached_mb:16,idle_release_ms:250") };
    let config = PoolConfig::from_env().unwrap();
    assert_eq!(
        config,
        PoolConfig::new()
            .max_cached_bytes(16 << 20)
            .idle_release(std::time::Duration::from_millis(250))
    );
    // SAFETY: as above.
    unsafe { std::env::set_var(POOL_CONF_VAR, "max_cached_mb:16,bogus:1") };
    assert!(matches!(
        PoolConfig::from_env(),
        Err(ConfigError::UnknownKey { .. })
    ));
    assert!(pinned_pool::Pool::from_env().is_err());
    // SAFETY: as above.
    unsafe { std::env::remove_var(POOL_CONF_VAR) };
    assert_eq!(PoolConfig::from_env().unwrap(), PoolConfig::new());
}
