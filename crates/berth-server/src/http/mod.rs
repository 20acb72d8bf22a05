//! The HTTP surface: the TLS listener, authentication and extractors, the API routes and the web
//! UI. Adapters only: a handler parses, calls the application layer (`services`), and answers.

pub mod auth;
pub mod extract;
pub mod openapi;
pub mod routes;
pub mod tls;
pub mod trace;
pub mod ui;
