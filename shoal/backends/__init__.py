"""Optional inference backends beside the torch engine; each is imported only when asked for."""
