"""Weight versions: what a trainer publishes (:mod:`.update`) and the files it writes (:mod:`.manifest`)."""
