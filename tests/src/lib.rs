//! Helpers for kvroute end-to-end tests: spawning real processes on free loopback ports.
