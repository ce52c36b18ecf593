echo hi # TODO later
