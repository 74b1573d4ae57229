//! The UTC calendar date and time of now, without a date crate: days since 1970 to a civil date
//! (Howard Hinnant's algorithm, the proleptic Gregorian calendar).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Utc {
    pub year: i64,
    /// 1 to 12.
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl Utc {
    pub fn now() -> Utc {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Utc::at(secs as i64)
    }

    /// Seconds since 1970-01-01 00:00:00 UTC.
    pub fn at(secs: i64) -> Utc {
        let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        Utc {
            year: yoe + era * 400 + i64::from(month <= 2),
            month: month as u32,
            day: day as u32,
            hour: (rest / 3600) as u32,
            minute: (rest / 60 % 60) as u32,
            second: (rest % 60) as u32,
        }
    }
}

impl std::fmt::Display for Utc {
    /// `2026-12-03 23:59:59Z`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02}Z",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

#[cfg(test)]
mod tests {
    use super::Utc;

    #[test]
    fn dates_are_calendar_dates() {
        assert_eq!(Utc::at(0).to_string(), "1970-01-01 00:00:00Z");
        assert_eq!(Utc::at(951_782_400).to_string(), "2000-02-29 00:00:00Z");
        assert_eq!(Utc::at(1_796_342_399).to_string(), "2026-12-03 23:59:59Z");
        assert_eq!(Utc::at(-1).to_string(), "1969-12-31 23:59:59Z");
    }
}
