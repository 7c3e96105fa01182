"""What a request's head may hold before it reaches the app, and the connections a server takes
(:mod:`.limits`), enforced in uvicorn's protocol (:mod:`.protocol`). Light: no app is built here."""
