"""Client-side helpers under Twinkle's server module path (twinkle.server.common)."""
