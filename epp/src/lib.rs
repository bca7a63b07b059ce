//! kvroute endpoint picker (EPP).
