//! clade-agent: the program inside every sandbox (init, host connection, process/file/identity/clock
//! operations) and the versioned wire format the host side imports.
